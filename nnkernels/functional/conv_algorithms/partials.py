"""The ordered sum that ends every split reduction: the dw reduce over the fp32 partial rows a split dw kernel
writes, and the split-K sum of a split forward (`Conv2dDwReduce` both)."""
from __future__ import annotations

import torch

from ...ops.conv2d.partials import Conv2dDwReduce, dw_partial_size
from ..common import allocator
from .base import clamp_pow2, make_kernel, pow2_at_least

REDUCE_TILE = 8192  # fp32 values one reduce program loads at once: 64 per thread of its 4 warps


def reduce_tile(positions: int, taps: int, machine) -> tuple[int, int, int]:
    """(TAP_BLOCK, SPLIT_ROWS, BLOCK) of the reduce over `positions` = N_DW / taps, all taps of BLOCK positions
    per program: enough programs for two per SM, 128 to 1024 // TAP_BLOCK positions each (the interpreter takes
    the widest), and REDUCE_TILE values loaded at once (SPLIT_ROWS split rows, up to 64), since a program sums
    its rows group after group, bound by memory latency."""
    tap_block = pow2_at_least(taps)
    high = max(128, 1024 // tap_block)
    block = clamp_pow2(positions // (2 * machine.sms), 128, high) if machine.gpu else high
    return tap_block, clamp_pow2(REDUCE_TILE // (tap_block * block), 1, 64), block


def reduce_kernel(p, with_bias, taps=1):
    """The dw reduce of problem p; `taps` = KH*KW after the TMA dw (tap-major partials), 1 for dw-ordered ones."""
    positions = p.C_OUT * p.cin_per_group * p.KH * p.KW // taps
    return make_kernel(Conv2dDwReduce, (with_bias, taps, *reduce_tile(positions, taps, p.machine)), p, num_warps=4,
                       num_stages=1)


def split_sum_kernel(p, numel):
    """The ordered sum of a split-K forward's fp32 partials into y (the dw reduce with TAPS = 1)."""
    return make_kernel(Conv2dDwReduce, (False, 1, *reduce_tile(numel, 1, p.machine)), p, num_warps=4, num_stages=1)


def partial_row(p, with_bias):
    """Elements of one partial row of p's weight gradient (and bias gradient, `with_bias`)."""
    return dw_partial_size(p.C_OUT, p.cin_per_group, p.KH, p.KW, with_bias)


def dw_split(tiles: int, pixels: int, block_k: int, oversubscribe: int, machine) -> int:
    """Pixel slices of a dw launch: about `oversubscribe` programs per SM, each slice at least four K-steps."""
    most = max(1, pixels // (4 * block_k))
    return max(1, min(most, -(-oversubscribe * machine.sms // tiles)))


def summed_weight_gradient(p, reduce, new):
    """sum_of(partial, *sizes) -> (dw, dbias): `reduce(partial, dw, dbias, *sizes)` into a new dw (and dbias, where
    p has a bias) from `new`; without a bias dw stands in its place (the kernel writes it only with HAS_BIAS)."""
    w_shape, c_out, with_bias = p.w_shape, p.C_OUT, p.has_bias

    def sum_of(partial, *sizes):
        dw = new(*w_shape)
        dbias = new(c_out) if with_bias else None
        reduce(partial, dw, dw if dbias is None else dbias, *sizes)
        return dw, dbias

    return sum_of


def split_weight_gradient(p, split, product, reduce, sizes, operands):
    """The runner of a split dw: `product(*operands(dy, x, copies), partial, *sizes, split)` into `split` fp32 rows,
    then `reduce` their ordered sum into dw (and dbias, where p has a bias)."""
    row, c_out, n_dw = partial_row(p, p.has_bias), p.C_OUT, p.C_OUT * p.cin_per_group * p.KH * p.KW
    new_f32 = allocator(torch.float32, p.device)
    sum_of = summed_weight_gradient(p, reduce, allocator(p.dtype, p.device))

    def run(dy, x, copies):
        partial = new_f32(split, row)
        product(*operands(dy, x, copies), partial, *sizes, split)
        return sum_of(partial, split, n_dw, c_out)

    return run
