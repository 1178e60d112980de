"""Channels-last convolutions whose tiles are TMA boxes (`ops/conv2d/tma_*.py`; compute capability 9.0 and up, and
the interpreter): the forward (strides that divide the planes), first on small planes, a strided layer's dx (a
stride-1 dx runs as a forward), and dw of any stride, which writes tap-major partials."""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.tma_dw import Conv2dTmaDw
from ...ops.conv2d.tma_dx import Conv2dTmaDx
from ...ops.conv2d.tma_forward import Conv2dTmaForward
from .base import Algorithm, GemmConfig, clamp_pow2, make_kernel, pow2_at_least, pow2_dividing, register
from .channels_last import (TMA_FORWARD_FIRST_PIXELS, ClDx, channels_last_operand_copies, channels_last_operands,
                            forward_copies, forward_runner, split_k, tma_boxes_fit, tma_rows_fit)
from .partials import reduce_kernel, split_sum_kernel, split_weight_gradient


def tma_box(rows: int, cols: int, pixels: int) -> tuple[int, int]:
    """(BOX_H, BOX_W) of `pixels` (a power of two) for planes of rows x cols: the box that wastes the least on the
    planes' ragged edges (56x56: 8x8 boxes fit exactly; 7x7: 8x8 boxes hold 49 of 64), the wider one among equals
    (longer runs of addresses)."""
    def covered(box_w):
        box_h = pixels // box_w
        return -(-rows // box_h) * box_h * -(-cols // box_w) * box_w

    widths = [1 << i for i in range(pixels.bit_length()) if 1 << i <= pixels]
    box_w = min(widths, key=lambda w: (covered(w), -w))
    return pixels // box_w, box_w


def tma_forward_box(block_m: int, rows: int, cols: int) -> tuple[int, int, int]:
    """(BOX_B, BOX_H, BOX_W) of `Conv2dTmaForward` for `block_m` pixels (a power of two) of rows x cols planes:
    whole planes rounded up to powers of two, several images of them where they are smaller than `block_m`, else
    `tma_box`'s box."""
    plane_h, plane_w = pow2_at_least(rows), pow2_at_least(cols)
    if plane_h * plane_w <= block_m:
        return block_m // (plane_h * plane_w), plane_h, plane_w
    return (1, *tma_box(rows, cols, block_m))


def box_programs(block_m: int, images: int, plane: tuple[int, int], n: int, block_n: int) -> int:
    """Programs of a launch over `images` planes of rows x cols pixels, in `tma_forward_box` boxes of `block_m`
    pixels by `block_n` of n channels."""
    box_b, box_h, box_w = tma_forward_box(block_m, *plane)
    return -(-images // box_b) * -(-plane[0] // box_h) * -(-plane[1] // box_w) * -(-n // block_n)


def wide_first(narrow: list[GemmConfig], wide: list[GemmConfig], wide_programs: int, machine) -> list[GemmConfig]:
    """128-pixel tiles before 64-pixel ones where they still make a program for every SM: a 128-row tile reads
    each weight slice once for twice the pixels, which won by 1.1x to 1.3x where there were programs enough."""
    return wide + narrow if wide_programs >= machine.sms else narrow + wide


def tma_forward_candidates(batch: int, plane: tuple[int, int], n: int, c_in: int, dtype, taps: int,
                           machine) -> list[GemmConfig]:
    """Configs of `Conv2dTmaForward`: boxes of 64 output pixels (`tma_forward_box`) by BLOCK_N channels (128, or
    C_OUT's power of two) on one warpgroup, 4 then 3 pipeline stages, each also split over K when its programs
    are fewer than the SMs; and boxes of 128 pixels on one warpgroup then two, first where they fill the SMs
    (`wide_first`). The interpreter takes one box set over many images."""
    block_n = clamp_pow2(n, 16, 128)
    block_k = min(64 if dtype != torch.float32 else 32, pow2_dividing(c_in))
    if not machine.gpu:
        return [GemmConfig(4096, block_n, block_k, 4, 1)]
    narrow = []
    for stages in (4, 3):
        config = GemmConfig(64, block_n, block_k, 4, stages)
        narrow += split_k(config, box_programs(64, batch, plane, n, block_n), taps * c_in, machine)
    wide = [GemmConfig(128, block_n, block_k, warps, 3) for warps in (4, 8)]
    return wide_first(narrow, wide, box_programs(128, batch, plane, n, block_n), machine)


def tma_dx_candidates(batch: int, phases: int, phase_plane: tuple[int, int], c_in: int, c_out: int, dtype,
                      machine) -> list[GemmConfig]:
    """Configs of `Conv2dTmaDx` for `phases` stride phases of phase_plane pixels per image: boxes of 64 phase
    pixels by BLOCK_N = 128 channels c_in (or C_IN's power of two) on one warpgroup, 4 then 3 pipeline stages, and
    128-pixel boxes on two, first where they fill the SMs (`wide_first`); K slices of 128 bytes dividing C_OUT.
    The interpreter takes one box set over many images."""
    block_n = clamp_pow2(c_in, 16, 128)
    block_k = min(64 if dtype != torch.float32 else 32, pow2_dividing(c_out))
    if not machine.gpu:
        return [GemmConfig(4096, block_n, block_k, 4, 1)]
    narrow = [GemmConfig(64, block_n, block_k, 4, 4), GemmConfig(64, block_n, block_k, 4, 3)]
    wide = [GemmConfig(128, block_n, block_k, 8, 3)]
    return wide_first(narrow, wide, phases * box_programs(128, batch, phase_plane, c_in, block_n), machine)


def tma_dw_candidates(c_out: int, c_in: int, kh: int, kw: int, batch: int, rows: int, cols: int, dtype,
                      machine) -> list[GemmConfig]:
    """Configs of `Conv2dTmaDw`: BLOCK_M c_out x BLOCK_N c_in tiles, boxes of `block_k` pixels (128 bytes of a
    64-channel row), one tap or a row of KW taps per program (one dy box then serves the row), and the boxes split
    so that a given number of programs per SM run (at most that: a second, nearly empty wave would double the
    time). 16-bit types: 128 x 64 tiles of one tap at 3 programs per SM first, then rows of taps on 64 x 64 tiles,
    then 128 x 128; fp32 starts with rows of taps over 64 x 64 tiles, 128 x 128 tiles and 128 x 64 at 6 per SM."""
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(c_out, 16, 64), clamp_pow2(c_in, 16, 64), 64, 4, 1, 1, kw)]
    block_k = 64 if dtype != torch.float32 else 32
    box_h, box_w = tma_box(rows, cols, block_k)
    boxes = batch * -(-rows // box_h) * -(-cols // box_w)
    order = [(128, 64, 8, 3, 1, 3), (64, 64, 4, 3, kw, 2), (128, 128, 8, 3, 1, 1), (128, 64, 8, 3, 1, 6),
             (64, 64, 4, 3, kw, 3), (64, 64, 8, 3, 1, 4)]
    if dtype == torch.float32:
        order = [order[1], order[2], order[3], order[4], order[0], order[5]]
    configs = []
    for block_m, block_n, warps, stages, taps, per_sm in order:
        block_m, block_n = clamp_pow2(c_out, 16, block_m), clamp_pow2(c_in, 16, block_n)
        tiles = -(-c_out // block_m) * -(-c_in // block_n) * (kh * kw // taps)
        split = max(1, min(boxes, per_sm * machine.sms // tiles))
        configs.append(GemmConfig(block_m, block_n, block_k, warps, stages, split, taps))
    return list(dict.fromkeys(configs))


class TmaForward(Algorithm):
    name = "tma_forward"
    channels_last_input = True

    def applies(self, p):
        return p.forward_channels_last and tma_boxes_fit(p)

    def candidates(self, p):
        batch, _, _, oh, ow = p.pixel_grid
        return tma_forward_candidates(batch, (oh, ow), p.C_OUT, p.C_IN, p.dtype, p.KH * p.KW, p.machine)

    def ranks(self, p, count):
        """On planes of at most TMA_FORWARD_FIRST_PIXELS pixels, where boxes were faster, the first two before the
        channels-last forward's candidates and the rest each after the one of its index, so that quick tuning
        times that kernel's first guess too; last on larger planes."""
        if p.OH * p.OW > TMA_FORWARD_FIRST_PIXELS:
            return [1000 + index / 1000 for index in range(count)]
        return [-1 + index / 1000 if index < 2 else index - 1.5 for index in range(count)]

    def kernels(self, p, config):
        box = tma_forward_box(config.block_m, *p.pixel_grid[3:])
        constants = p.geometry + (p.has_bias, p.tf32, p.flip_taps, p.nhwc, *box, config.block_n, config.block_k,
                                  config.split)
        kernels = forward_copies(p) + [make_kernel(Conv2dTmaForward, constants, p, config)]
        return kernels + ([split_sum_kernel(p, p.B * p.C_OUT * p.OH * p.OW)] if config.split > 1 else [])

    def runner(self, p, config):
        return forward_runner(p, self.kernels(p, config), config.split)


class TmaDx(ClDx):
    """`ClDx` with its tiles copied as TMA boxes: a strided layer's dx (channels-last, `Problem.dx_nhwc`)."""

    name = "tma_dx"

    def applies(self, p):
        return tma_rows_fit(p) and p.dx_nhwc and p.stride != (1, 1)

    def candidates(self, p):
        return tma_dx_candidates(p.B, p.stride[0] * p.stride[1], p.phase_plane, p.C_IN, p.C_OUT, p.dtype,
                                 p.machine)

    def ranks(self, p, count):
        """Each before the channels-last dx's candidate of its index (quick tuning times the first of each)."""
        return [index - 0.5 for index in range(count)]

    def _product(self, p, config):
        box = tma_forward_box(config.block_m, *p.phase_plane)
        constants = p.geometry + (p.tf32, *box, config.block_n, config.block_k)
        return make_kernel(Conv2dTmaDx, constants, p, config)


class TmaDw(Algorithm):
    name = "tma_dw"
    channels_last_input = True

    def applies(self, p):
        return tma_rows_fit(p)

    def candidates(self, p):
        batch, _, _, oh, ow = p.pixel_grid
        return tma_dw_candidates(p.C_OUT, p.C_IN, p.KH, p.KW, batch, oh, ow, p.dtype, p.machine)

    def kernels(self, p, config):
        box = tma_box(*p.pixel_grid[3:], config.block_k)
        constants = p.geometry + (p.has_bias, p.tf32, config.taps, config.block_m, config.block_n) + box
        return channels_last_operand_copies(p) + [make_kernel(Conv2dTmaDw, constants, p, config),
                                                  reduce_kernel(p, p.has_bias, p.KH * p.KW)]

    def runner(self, p, config):
        product, reduce = (Launcher(k) for k in self.kernels(p, config)[-2:])
        return split_weight_gradient(p, config.split, product, reduce, p.grid_sizes, channels_last_operands(p))


FORWARD = register(TmaForward())
DX = register(TmaDx())
DW = register(TmaDw())
