"""How average pooling's passes cut their work (`ops/avg_pool2d/`), with the configs tuning chooses among.

Where its contract holds (rows of vector loads, windows within a group's reach; the backward only for one
divisor for every window), a pass takes the lanes kernel, tuned over `LanesConfig`s; otherwise the gather
kernel, which takes every case, with one `GatherConfig` from a rule. On channels-last tensors a pass takes the
channels-last kernels, tuned over `ChannelsLastTile`s.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..launcher import Launcher
from ..ops.avg_pool2d.channels_last import AvgPool2dClBackward, AvgPool2dClForward
from ..ops.avg_pool2d.gather import (AvgPool2dGatherBackward, AvgPool2dGatherForward, contiguous_row_align,
                                     row_align, uniform_divisor)
from ..ops.avg_pool2d.lanes import (AvgPool2dLanesBackward, AvgPool2dLanesForward, backward_lane_widths,
                                    backward_lanes, backward_src_vec, forward_lane_widths, forward_lanes)
from ..ops.common.host_math import cdiv, channel_alignment, next_power_of_2
from .common import allocator, channels_last_allocator, kernel, stored_config
from .nhwc_tiles import ChannelsLastTile, nhwc_tiles

INTERPRETER_TILE = 2**16


@dataclass(frozen=True)
class LanesConfig:
    """A lanes-kernel launch: `block_r` rows per program, `block_g` groups of `lanes` per row, `num_warps`."""

    block_r: int
    block_g: int
    lanes: int
    num_warps: int


@dataclass(frozen=True)
class GatherConfig:
    """A gather-kernel launch: `block_r` rows by `block_w` columns per program, `num_warps`."""

    block_r: int
    block_w: int
    num_warps: int


def pooling_blocks(rows, cols, machine, *, tile=None):
    """(BLOCK_R, BLOCK_W) for a rows x cols grid of outputs: about `tile` elements per program on the GPU; in the
    interpreter, few programs as large as the problem."""
    tile = tile or (2048 if machine.gpu else INTERPRETER_TILE)
    block_w = min(next_power_of_2(cols), tile, 64 if machine.gpu else INTERPRETER_TILE)
    block_r = max(1, min(tile // block_w, next_power_of_2(rows)))
    return block_r, block_w


def gather_config(rows, cols, taps, machine) -> GatherConfig:
    """The gather kernel's program for `taps` loads per written element: 32 elements per thread for a single tap,
    16 up to 4 taps, 8 beyond (register pressure)."""
    if not machine.gpu:
        return GatherConfig(*pooling_blocks(rows, cols, machine), 4)
    tile, num_warps = (4096, 4) if taps == 1 else (2048, 4) if taps <= 4 else (2048, 8)
    return GatherConfig(*pooling_blocks(rows, cols, machine, tile=tile), num_warps)


def lanes_tile(rows, groups, lanes, tile):
    """(BLOCK_R, BLOCK_G) of a lanes program that writes about `tile` elements: up to 512 columns of `groups`
    groups of `lanes` per row, then as many rows as fill the tile."""
    block_g = min(next_power_of_2(groups), max(1, 512 // lanes))
    block_r = max(1, min(tile // (block_g * lanes), next_power_of_2(rows)))
    return block_r, block_g


# (elements written per program, num_warps) of the lanes candidates per element size, the first guess first.
LANES_PROGRAMS = {
    4: ((2048, 4), (1024, 4), (4096, 4), (4096, 8), (8192, 8)),
    2: ((2048, 4), (1024, 4), (4096, 4), (512, 2), (2048, 2), (4096, 8)),
}


def lanes_candidates(rows, written, widths, first_lanes, itemsize, machine) -> list[LanesConfig]:
    """Configs of a lanes launch over `rows` written rows of `written` elements, the first guess first.

    `widths`: the LANES the kernel takes for this shape; `first_lanes` the first guess among them (a 16-byte
    group). On the GPU: the program sizes of LANES_PROGRAMS with `first_lanes`, then the first size with the next
    wider width (two vectors per group) or, where there is none, the next narrower, last (wider fp32 groups split
    their lanes through shared memory; narrower bf16 groups take 8-byte loads). The interpreter: one config,
    programs as large as the problem."""
    def config(lanes, tile, num_warps):
        return LanesConfig(*lanes_tile(rows, cdiv(written, lanes), lanes, tile), lanes, num_warps)

    if not machine.gpu:
        return [config(first_lanes, INTERPRETER_TILE, 4)]
    programs = LANES_PROGRAMS[4 if itemsize >= 4 else 2]
    configs = [config(first_lanes, tile, warps) for tile, warps in programs]
    wider = [lanes for lanes in widths if lanes > first_lanes]
    narrower = [lanes for lanes in widths if lanes < first_lanes]
    other = wider[-1] if wider else narrower[0] if narrower else None
    if other is not None:
        configs.append(config(other, *programs[0]))
    return list(dict.fromkeys(configs))


class PoolingPass:
    """One pass (`direction` "forward" or "backward") of one pooling problem: its tuning kind and key, its
    candidates, the kernel a config makes, and a runner."""

    def __init__(self, direction, dtype, planes, H, W, OH, OW, kernel_size, stride, padding, count_include_pad,
                 divisor, machine, device):
        self.direction, self.dtype, self.machine, self.device = direction, dtype, machine, device
        self.sizes = (planes, H, W, OH, OW)
        shape = (planes, H, W, OH, OW, tuple(kernel_size), tuple(stride), tuple(padding), count_include_pad, divisor)
        self.key = (str(dtype).replace("torch.", ""), *shape)
        # The window options under the attribute names `uniform_divisor` and the lane rules read.
        options = SimpleNamespace(kh=kernel_size[0], kw=kernel_size[1], stride_h=stride[0], stride_w=stride[1],
                                  pad_h=padding[0], pad_w=padding[1], count_include_pad=count_include_pad,
                                  divisor_override=divisor)
        self.options = options
        uniform = uniform_divisor(options, H, W, OH, OW)
        self.common = (*kernel_size, *stride, *padding, count_include_pad, divisor, uniform)
        itemsize = dtype.itemsize
        if direction == "backward":
            self.rows, self.cols = planes * H, W
            self.lanes = backward_lanes(options, W, OW, itemsize, uniform)[0]
            self.widths = backward_lane_widths(options, W, uniform) if self.lanes else ()
            # Each dx gathers from the windows that may cover it: cdiv(k, stride) per axis.
            self.taps = cdiv(kernel_size[0], stride[0]) * cdiv(kernel_size[1], stride[1])
        else:
            self.rows, self.cols = planes * OH, OW
            self.lanes = forward_lanes(options, W, itemsize)
            self.widths = forward_lane_widths(options, W) if self.lanes else ()
            self.taps = kernel_size[0] * kernel_size[1]
        self.kind = f"avg_pool2d_{'lanes' if self.lanes else 'gather'}_{direction}"
        self.decode = stored_config(LanesConfig if self.lanes else GatherConfig)

    def candidates(self):
        if self.lanes:
            return lanes_candidates(self.rows, self.cols, self.widths, self.lanes, self.dtype.itemsize, self.machine)
        return [gather_config(self.rows, self.cols, self.taps, self.machine)]

    def kernel(self, config):
        dtype, common, cols = self.dtype, self.common, self.cols
        if isinstance(config, GatherConfig):
            if self.direction == "backward":
                return kernel(AvgPool2dGatherBackward, *common, row_align(cols), config.block_r, config.block_w,
                              dtype=dtype, num_warps=config.num_warps)
            align = contiguous_row_align(self.options, self.sizes[2], self.sizes[4])
            return kernel(AvgPool2dGatherForward, *common, row_align(cols), align, config.block_r, config.block_w,
                          dtype=dtype, num_warps=config.num_warps)
        if self.direction == "backward":
            src_vec = backward_src_vec(self.options, self.sizes[4], config.lanes)
            return kernel(AvgPool2dLanesBackward, *common, config.lanes, src_vec, min(row_align(cols), config.lanes),
                          config.block_r, config.block_g, dtype=dtype, num_warps=config.num_warps)
        return kernel(AvgPool2dLanesForward, *common, config.lanes, min(row_align(cols), config.lanes), config.block_r,
                      config.block_g, dtype=dtype, num_warps=config.num_warps)

    def runner(self, config, out_shape):
        """run(source) -> out: the forward's y from x, or the backward's dx from dy (every config writes all of it)."""
        launch, sizes, new = Launcher(self.kernel(config)), self.sizes, allocator(self.dtype, self.device)

        def run(source):
            out = new(*out_shape)
            launch(source, out, *sizes)
            return out

        return run


class ChannelsLastPoolingPass:
    """`PoolingPass` on channels-last tensors: x and y (dy and dx) read and written as the NHWC arrays they store,
    by `AvgPool2dClForward` or `AvgPool2dClBackward`."""

    def __init__(self, direction, dtype, batch, channels, H, W, OH, OW, kernel_size, stride, padding,
                 count_include_pad, divisor, machine, device):
        self.direction, self.dtype, self.machine, self.device = direction, dtype, machine, device
        self.sizes = (batch, channels, H, W, OH, OW)
        self.key = (str(dtype).replace("torch.", ""), batch, channels, H, W, OH, OW, tuple(kernel_size),
                    tuple(stride), tuple(padding), count_include_pad, divisor)
        options = SimpleNamespace(kh=kernel_size[0], kw=kernel_size[1], stride_h=stride[0], stride_w=stride[1],
                                  pad_h=padding[0], pad_w=padding[1], count_include_pad=count_include_pad,
                                  divisor_override=divisor)
        self.common = (*kernel_size, *stride, *padding, count_include_pad, divisor,
                       uniform_divisor(options, H, W, OH, OW))
        self.pixels = batch * (H * W if direction == "backward" else OH * OW)
        self.kind = f"avg_pool2d_nhwc_{direction}"
        self.decode = stored_config(ChannelsLastTile)

    def candidates(self):
        return nhwc_tiles(self.pixels, self.sizes[1], self.machine)

    def kernel(self, config):
        cls = AvgPool2dClBackward if self.direction == "backward" else AvgPool2dClForward
        return kernel(cls, *self.common, config.block_p, config.block_c,
                      channel_alignment(self.sizes[1], self.dtype.itemsize), dtype=self.dtype,
                      num_warps=config.num_warps)

    def runner(self, config, out_shape):
        """run(source) -> out, both channels-last [N, C, H, W] tensors (every config writes all of out)."""
        launch, sizes, new = Launcher(self.kernel(config)), self.sizes, channels_last_allocator(self.dtype, self.device)

        def run(source):
            out = new(*out_shape)
            launch(source.permute(0, 2, 3, 1), out.permute(0, 2, 3, 1), *sizes)
            return out

        return run
