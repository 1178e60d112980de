"""Depthwise convolution on a channels-last problem: the kernels of `ops/conv2d/depthwise_cl.py` read and write
the channels-last tensors where they lie, where the NCHW depthwise kernels run through two layout copies. Both
stand in one tier, so tuning times them against each other."""
from __future__ import annotations

from dataclasses import dataclass

from ...launcher import Launcher
from ...ops.conv2d.depthwise_cl import Conv2dDepthwiseClDw, Conv2dDepthwiseClDx, Conv2dDepthwiseClForward
from ..common import channels_last_allocator
from .base import Algorithm, clamp_pow2, make_kernel, register
from .partials import reduce_kernel, split_weight_gradient

# Elements of a program's [BLOCK_P, BLOCK_C] tile on the GPU (each a first guess, then the others), and in the
# interpreter, which pays per program.
GPU_TILES = (2048, 1024, 4096)
INTERPRETER_TILE = 2**15
WIDEST_CHANNELS = 64  # channels of a pixel one program reads: 128 bytes of bf16
MOST_DW_SPLIT = 1024  # most fp32 partial rows of dw (each C*(KH*KW+1) floats)


@dataclass(frozen=True)
class ChannelsLastTile:
    """A program's BLOCK_P pixels by BLOCK_C channels, with `num_warps` warps."""

    block_p: int
    block_c: int
    num_warps: int


def tiles(p, pixels: int) -> list[ChannelsLastTile]:
    """Tiles over `pixels` pixels of p's C channels: as many channels as a pixel has up to WIDEST_CHANNELS,
    then pixels up to each of GPU_TILES elements (the interpreter: one large tile)."""
    block_c = clamp_pow2(p.C_IN, 1, WIDEST_CHANNELS)
    sizes = GPU_TILES if p.machine.gpu else (INTERPRETER_TILE,)
    found = [ChannelsLastTile(clamp_pow2(pixels, 1, max(1, size // block_c)), block_c, 4) for size in sizes]
    return list(dict.fromkeys(found))


def _kernel(p, cls, flags, tile):
    return make_kernel(cls, p.geometry + flags + (tile.block_p, tile.block_c), p, num_warps=tile.num_warps,
                       num_stages=1)


def _stored(t):
    """A channels-last [N, C, H, W] tensor as the [N, H, W, C] array it stores."""
    return t.permute(0, 2, 3, 1)


class _DepthwiseChannelsLast(Algorithm):
    config_type = ChannelsLastTile
    channels_last_input = True

    def applies(self, p):
        return p.depthwise and p.nhwc


class DepthwiseClForward(_DepthwiseChannelsLast):
    name = "depthwise_cl_forward"

    def candidates(self, p):
        return tiles(p, p.B * p.OH * p.OW)

    def kernels(self, p, tile):
        return [_kernel(p, Conv2dDepthwiseClForward, (p.has_bias,), tile)]

    def runner(self, p, tile):
        launch, new, shape, sizes = Launcher(self.kernels(p, tile)[0]), channels_last_allocator(p.dtype, p.device), \
            p.y_shape, p.launch_sizes

        def run(x, weight, bias):
            y = new(*shape)
            out = _stored(y)
            launch(_stored(x), weight, out if bias is None else bias, out, *sizes)
            return y

        return run


class DepthwiseClDx(_DepthwiseChannelsLast):
    name = "depthwise_cl_dx"

    def candidates(self, p):
        return tiles(p, p.B * p.H * p.W)

    def kernels(self, p, tile):
        return [_kernel(p, Conv2dDepthwiseClDx, (), tile)]

    def runner(self, p, tile):
        launch, new, shape, sizes = Launcher(self.kernels(p, tile)[0]), channels_last_allocator(p.dtype, p.device), \
            p.x_shape, p.launch_sizes

        def run(dy, weight, dy_cl):
            dx = new(*shape)
            launch(_stored(dy), weight, _stored(dx), *sizes)
            return dx

        return run


class DepthwiseClDw(_DepthwiseChannelsLast):
    name = "depthwise_cl_dw"

    def candidates(self, p):
        return tiles(p, p.B * p.OH * p.OW)

    def kernels(self, p, tile):
        return [_kernel(p, Conv2dDepthwiseClDw, (p.has_bias,), tile), reduce_kernel(p, p.has_bias)]

    def runner(self, p, tile):
        product, reduce = (Launcher(k) for k in self.kernels(p, tile))
        return split_weight_gradient(p, dw_split(p, tile), product, reduce, p.launch_sizes,
                                     lambda dy, x, copies: (_stored(dy), _stored(x)))


def dw_split(p, tile: ChannelsLastTile) -> int:
    """Slices of dw's pixel blocks: about four programs per SM over the channel blocks, up to MOST_DW_SPLIT, and
    no more than there are blocks (the interpreter: one)."""
    if not p.machine.gpu:
        return 1
    blocks = -(-p.B * p.OH * p.OW // tile.block_p)
    channel_blocks = -(-p.C_IN // tile.block_c)
    return max(1, min(blocks, MOST_DW_SPLIT, -(-4 * p.machine.sms // channel_blocks)))


FORWARD = register(DepthwiseClForward())
DX = register(DepthwiseClDx())
DW = register(DepthwiseClDw())
