"""Grouped convolutions (groups > 1, not depthwise) on the channels-last kernels (`ops/conv2d/channels_last*.py`):
a product tile of BLOCK_N channels spans the groups those channels belong to and multiplies a block-diagonal weight
tile, which `Conv2dGroupedWeight` writes once per call (`expanded_weight`). Here: their candidate configs, and that
weight. ResNeXt's groups hold 4 to 32 channels: a tile per group would leave most of each 16-wide tensor-core
product empty; a tile of several groups fills it, multiplying the zeros of the block-diagonal weight too."""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.channels_last import window_width
from ...ops.conv2d.grouped_weight import Conv2dGroupedWeight
from ..common import allocator
from .base import GemmConfig, clamp_pow2, make_kernel, pow2_at_least
from .implicit_gemm import gemm_candidates
from .partials import dw_split


def grouped_candidates(batch: int, pixels_per_image: int, n_per_group: int, k_per_group: int, groups: int, dtype,
                       machine) -> list[GemmConfig]:
    """Configs of the channels-last forward and dx kernels on a grouped problem: BLOCK_N channels (n) a tile,
    reducing over the `k_per_group` channels of each group the tile touches, tap by tap, BLOCK_K of them a step
    (16 at least; 64 bytes of fp32 or 128 of 16-bit data at most). GPU: each of the one-group kernels' pixel tiles
    (`gemm_candidates`, no wider than a power of two above the plane) on tiles of 16, 32 and 64 channels (a
    group's where wider), in that order, so that quick tuning times the three widths (full tuning on the H200
    chose 32 for most of ResNeXt-50's layers in bf16)."""
    wide = 64 if dtype != torch.float32 else 32
    group = clamp_pow2(n_per_group, 16, 128)
    widths = list(dict.fromkeys([group, max(group, 32), max(group, 64)] if machine.gpu else [group]))
    widest = max(64, pow2_at_least(pixels_per_image)) if machine.gpu else 4096
    by_width = []
    for block_n in widths:
        window = window_width(k_per_group * groups, k_per_group, n_per_group, block_n, groups)
        block_k = clamp_pow2(window, 16, wide if machine.gpu else 128)
        by_width.append([GemmConfig(min(c.block_m, widest), block_n, block_k, c.num_warps, c.num_stages)
                         for c in gemm_candidates(batch * pixels_per_image, block_n, window, dtype, machine)[:3]])
    return list(dict.fromkeys(config for row in zip(*by_width) for config in row))


def dw_tap_span(block_n: int, window: int) -> int:
    """Taps a dw column tile of `block_n` spans: a tile wider than its `window` of input channels, and a whole
    multiple of it, holds several taps of all of them."""
    return block_n // window if block_n > window and block_n % window == 0 else 1


def grouped_dw_candidates(p) -> list[GemmConfig]:
    """Configs of the channels-last dw kernel on a grouped problem: BLOCK_M output channels (64, then 16 or a
    group's, then 128; narrow groups share a tile) by the input channels of their groups (`window_width`), in
    column tiles of up to 128, or of two or four taps of all of them where they are few (a dy tile then serves
    each of those taps); split over the pixels as the one-group kernel's, and the first tile also four times as
    finely (a grouped weight is small, so more partial rows cost little): the 64-row tile is what full tuning
    chose on the H200 for every ResNeXt-50 layer (docs/notes.md, "Grouped convolution")."""
    n_per_group, taps, pixels = p.C_OUT // p.groups, p.KH * p.KW, p.B * p.OH * p.OW
    group = clamp_pow2(n_per_group, 16, 128)
    if not p.machine.gpu:
        window = window_width(p.C_IN, p.cin_per_group, n_per_group, group, p.groups)
        return [GemmConfig(group, clamp_pow2(window, 16, 128), clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    wide = 64 if p.dtype != torch.float32 else 32
    configs = []
    for block_m, warps in ((max(group, 64), 4), (group, 4), (max(group, 128), 8)):
        window = window_width(p.C_IN, p.cin_per_group, n_per_group, block_m, p.groups)
        spans = [1] if window > 32 or window & (window - 1) else [2, 4, 1]
        for span in spans:
            block_n = min(128, max(16, pow2_at_least(window) * span))
            span = dw_tap_span(block_n, window)
            tiles = -(-p.C_OUT // block_m) * -(-taps // span) * -(-window // (block_n // span))
            for oversubscribe in (2, 8) if not configs else (2,):
                configs.append(GemmConfig(block_m, block_n, wide, warps, 3,
                                          dw_split(tiles, pixels, wide, oversubscribe, p.machine)))
    return list(dict.fromkeys(configs))


def _expansion(p, dx):
    """(rows, n per group, r per group, transposed, taps outer) of the weight p's forward (`dx` False; of a
    `dx_forward` problem too, whose weight is the convolution's own, transposed) or strided dx reads."""
    if dx:
        return p.C_IN, p.cin_per_group, p.C_OUT // p.groups, True, True
    return p.C_OUT, p.C_OUT // p.groups, p.cin_per_group, p.flip_taps, False


def _weight_kernel(p, width, transposed, taps_outer):
    block_j = clamp_pow2(width, 16, 128)
    return make_kernel(Conv2dGroupedWeight, (transposed, taps_outer, max(1, 4096 // block_j), block_j), p,
                       num_warps=4, num_stages=1)


def expanded_weight_kernels(p, tile_n: int, dx: bool = False) -> list:
    """The launch `expanded_weight(p, tile_n, dx)` makes."""
    _, n, r, transposed, taps_outer = _expansion(p, dx)
    return [_weight_kernel(p, window_width(r * p.groups, r, n, tile_n, p.groups), transposed, taps_outer)]


def expanded_weight(p, tile_n: int, dx: bool = False):
    """weight ([C_OUT, C_IN/G, KH, KW], contiguous) -> the block-diagonal rows the channels-last forward (`dx`
    False) or strided dx kernel (`dx`) of tile width `tile_n` reads on grouped problem p (`Conv2dGroupedWeight`)."""
    rows, n, r, transposed, taps_outer = _expansion(p, dx)
    taps, width = p.KH * p.KW, window_width(r * p.groups, r, n, tile_n, p.groups)
    launch, new = Launcher(_weight_kernel(p, width, transposed, taps_outer)), allocator(p.dtype, p.device)
    sizes = (rows, taps, n, r, tile_n, width)

    def expand(weight):
        out = new(rows * taps * width)
        launch(weight, out, *sizes)
        return out

    return expand
