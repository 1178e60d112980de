"""Depthwise convolution on a channels-last problem: the kernels of `ops/conv2d/depthwise_cl.py` read and write
the channels-last tensors where they lie, where the NCHW depthwise kernels run through two layout copies. Both
stand in one tier, so tuning times them against each other."""
from __future__ import annotations

from ...launcher import Launcher
from ...ops.common.host_math import channel_alignment
from ...ops.conv2d.depthwise_cl import Conv2dDepthwiseClDw, Conv2dDepthwiseClDx, Conv2dDepthwiseClForward
from ..common import channels_last_allocator
from ..nhwc_tiles import ChannelsLastTile, nhwc_tiles
from .base import Algorithm, make_kernel, register
from .partials import reduce_kernel, split_weight_gradient

MOST_DW_SPLIT = 1024  # most fp32 partial rows of dw (each C*(KH*KW+1) floats)


def _stored(t):
    """A channels-last [N, C, H, W] tensor as the [N, H, W, C] array it stores."""
    return t.permute(0, 2, 3, 1)


class _DepthwiseChannelsLast(Algorithm):
    """A pass whose `kernel_class` launch (and, for dw, a reduce) tiles the pixels of y (of x where `tiles_x`: dx),
    with the HAS_BIAS flag where `takes_bias`."""
    config_type = ChannelsLastTile
    channels_last_input = True
    tiles_x = False

    def applies(self, p):
        return p.depthwise and p.nhwc

    def pixels(self, p):
        return p.B * (p.H * p.W if self.tiles_x else p.OH * p.OW)

    def candidates(self, p):
        return nhwc_tiles(self.pixels(p), p.C_IN, p.machine)

    def kernels(self, p, tile):
        flags = (p.has_bias,) if self.takes_bias else ()
        alignment = channel_alignment(p.C_IN, p.dtype.itemsize)
        return [make_kernel(self.kernel_class, p.geometry + flags + (tile.block_p, tile.block_c, alignment), p,
                            num_warps=tile.num_warps, num_stages=1)]


class _OneLaunch(_DepthwiseChannelsLast):
    """A pass of one launch into a new channels-last tensor shaped as the one it tiles, its arguments
    `arguments(...)`."""

    def runner(self, p, tile):
        launch, new = Launcher(self.kernels(p, tile)[0]), channels_last_allocator(p.dtype, p.device)
        shape, sizes, arguments = p.x_shape if self.tiles_x else p.y_shape, p.launch_sizes, self.arguments

        def run(first, weight, third):
            out = new(*shape)
            launch(*arguments(first, weight, third, _stored(out)), *sizes)
            return out

        return run


class DepthwiseClForward(_OneLaunch):
    name = "depthwise_cl_forward"
    kernel_class, takes_bias = Conv2dDepthwiseClForward, True

    @staticmethod
    def arguments(x, weight, bias, y):
        return _stored(x), weight, y if bias is None else bias, y


class DepthwiseClDx(_OneLaunch):
    name = "depthwise_cl_dx"
    kernel_class, takes_bias, tiles_x = Conv2dDepthwiseClDx, False, True

    @staticmethod
    def arguments(dy, weight, dy_cl, dx):
        return _stored(dy), weight, dx


class DepthwiseClDw(_DepthwiseChannelsLast):
    name = "depthwise_cl_dw"
    kernel_class, takes_bias = Conv2dDepthwiseClDw, True

    def kernels(self, p, tile):
        return super().kernels(p, tile) + [reduce_kernel(p, p.has_bias)]

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
