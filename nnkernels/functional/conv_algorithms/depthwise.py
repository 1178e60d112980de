"""Depthwise convolution (groups == C_IN == C_OUT): the direct kernels of `ops/conv2d/depthwise.py`, each pass one
launch (dw two: the split partial sums and their reduce). Memory-bound, so the tile is a rule, not tuned."""
from __future__ import annotations

from dataclasses import dataclass

from ...launcher import Launcher
from ...ops.conv2d.depthwise import Conv2dDepthwiseDw, Conv2dDepthwiseDx, Conv2dDepthwiseForward, gather_columns_fit
from .base import Algorithm, clamp_pow2, make_kernel, one_launch_dx, one_launch_forward, pow2_at_least, register
from .partials import reduce_kernel, split_weight_gradient

LANES = 128  # (plane, column) pairs of a program on the GPU: one per thread of 4 warps
INTERPRETER_LANES = 4096
BAND = 16  # most rows of a program's band
MOST_DW_SPLIT = 1024  # most fp32 partial rows of dw (each C*(KH*KW+1) floats)


@dataclass(frozen=True)
class DepthwiseTile:
    """What one program takes: `planes` planes, a band of `rows` rows and `block_w` columns of each, with
    `num_warps` warps."""

    planes: int
    rows: int
    block_w: int
    num_warps: int


def depthwise_tile(machine, planes: int, rows: int, cols: int, row_step: int = 1,
                   channels: int | None = None) -> DepthwiseTile:
    """The tile over `planes` planes of `rows` x `cols` pixels: up to 64 columns (a row is one run of addresses),
    then planes up to LANES (plane, column) pairs, one per thread. Bands of up to BAND rows, as even as the plane
    allows and a multiple of `row_step` (dx's stride): a band's input rows are loaded once for every output row
    that reads them. Bands are halved while there would be fewer than two programs per SM. `channels`: a
    program's planes are channels of one image (dw's), so no more than that many."""
    lanes = LANES if machine.gpu else INTERPRETER_LANES
    block_w = clamp_pow2(cols, 1, 64)
    planes_per_program = clamp_pow2(min(planes, channels or planes), 1, max(1, lanes // block_w))
    tiles = -(-planes // planes_per_program) * -(-cols // block_w)
    longest = BAND
    while longest > 2 * row_step and tiles * -(-rows // longest) < 2 * machine.sms:
        longest //= 2
    bands = -(-rows // max(longest, row_step))
    band = -(-rows // bands)
    band = -(-band // row_step) * row_step
    return DepthwiseTile(planes_per_program, band, block_w, max(1, min(4, planes_per_program * block_w // 32)))


def dw_split(p, tile: DepthwiseTile) -> int:
    """Slices of dw's work items (image, band, column tile): one per item, up to MOST_DW_SPLIT, so there are many
    short programs to hide memory latency with while the partial rows stay small next to dy."""
    if not p.machine.gpu:
        return 1
    return min(p.B * -(-p.OH // tile.rows) * -(-p.OW // tile.block_w), MOST_DW_SPLIT)


def _kernel(p, cls, flags, tile, gather_columns=()):
    constants = p.geometry + flags + (tile.planes, tile.rows, tile.block_w) + gather_columns
    return make_kernel(cls, constants, p, num_warps=tile.num_warps, num_stages=1)


def _gather_columns(p, tile):
    """The forward's and dw's GATHER_COLUMNS: x rows loaded once, their taps shifted across lanes, where they fit
    (not dx, which it made slower)."""
    return (gather_columns_fit(p.stride[1], p.KW, p.dilation[1], p.OW, tile.block_w),)


class _Depthwise(Algorithm):
    config_type = DepthwiseTile

    def applies(self, p):
        return p.depthwise


class DepthwiseForward(_Depthwise):
    name = "depthwise_forward"

    def candidates(self, p):
        return [depthwise_tile(p.machine, p.B * p.C_IN, p.OH, p.OW)]

    def kernels(self, p, tile):
        return [_kernel(p, Conv2dDepthwiseForward, (p.has_bias,), tile, _gather_columns(p, tile))]

    def runner(self, p, tile):
        return one_launch_forward(p, self.kernels(p, tile)[0], p.launch_sizes)


class DepthwiseDx(_Depthwise):
    name = "depthwise_dx"

    def candidates(self, p):
        return [depthwise_tile(p.machine, p.B * p.C_IN, p.H, p.W, row_step=p.stride[0])]

    def kernels(self, p, tile):
        return [_kernel(p, Conv2dDepthwiseDx, (), tile)]

    def runner(self, p, tile):
        return one_launch_dx(p, self.kernels(p, tile)[0], p.launch_sizes)


class DepthwiseDw(_Depthwise):
    name = "depthwise_dw"

    def candidates(self, p):
        return [depthwise_tile(p.machine, p.B * p.C_IN, p.OH, p.OW, channels=p.C_IN)]

    def kernels(self, p, tile):
        taps = pow2_at_least(p.KH * p.KW + 1)  # a column for the bias
        return [_kernel(p, Conv2dDepthwiseDw, (p.has_bias, taps), tile,
                        _gather_columns(p, tile) + (p.OH % tile.rows != 0,)),
                reduce_kernel(p, p.has_bias)]

    def runner(self, p, tile):
        product, reduce = (Launcher(k) for k in self.kernels(p, tile))
        return split_weight_gradient(p, dw_split(p, tile), product, reduce, p.launch_sizes,
                                     lambda dy, x, copies: (dy, x))


FORWARD = register(DepthwiseForward())
DX = register(DepthwiseDx())
DW = register(DepthwiseDw())
