"""The fp32 partial rows every split weight-gradient kernel writes, and their ordered sum: `Conv2dDwReduce`.

A split dw kernel writes, per slice s of its reduction, one row of `partial`: dw's C_OUT*(C_IN/G)*KH*KW sums
(in dw's order, or tap-major for the TMA dw), then C_OUT bias sums when it has a bias. `Conv2dDwReduce` adds
the rows in a fixed order and rounds once, so dw is bitwise reproducible run to run. `split_slice` is the
share of the reduction each slice sums.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid, check_numel
from ..common.host_math import cdiv


def dw_partial_size(c_out, cin_per_group, kh, kw, has_bias):
    """Elements of one split's row of `partial`: dw's C_OUT*(C_IN/G)*KH*KW, then C_OUT for dbias."""
    return c_out * cin_per_group * kh * kw + (c_out if has_bias else 0)


@triton.jit
def partial_row_length(N_DW, C_OUT, HAS_BIAS: tl.constexpr):
    """`dw_partial_size` in a kernel: N_DW weight sums, then C_OUT bias sums when HAS_BIAS."""
    if HAS_BIAS:
        return N_DW + C_OUT
    return N_DW


@triton.jit
def partial_row(partial, split, N_DW, C_OUT, HAS_BIAS: tl.constexpr):
    """Split `split`'s row of the fp32 partials every split dw kernel writes (`partial_row_length` long)."""
    return partial + split.to(tl.int64) * partial_row_length(N_DW, C_OUT, HAS_BIAS)


# The helpers of a kernel that calls `partial_row` (for its sources and content hash).
PARTIAL_ROW_HELPERS = (partial_row, partial_row_length)


@triton.jit
def split_slice(total, split, SPLIT, BLOCK: tl.constexpr):
    """[first, end) of slice `split` of a reduction over range(total) cut into SPLIT slices of whole BLOCK
    steps: first = split*L, end = min(first + L, total), L = cdiv(cdiv(total, SPLIT), BLOCK)*BLOCK."""
    slice_len = tl.cdiv(tl.cdiv(total, SPLIT), BLOCK) * BLOCK
    first = split * slice_len
    return first, tl.minimum(first + slice_len, total)


def conv2d_dw_reduce_entry(k, a):
    """Grid (cdiv(N_DW / TAPS, BLOCK),) for `Conv2dDwReduce`."""
    for name, value in (("split_rows", k.split_rows), ("tap_block", k.tap_block)):
        if value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value}")
    if k.tap_block < k.taps:
        raise ValueError(f"tap_block: expected at least taps = {k.taps}, got {k.tap_block}")
    if a.N_DW % k.taps:
        raise ValueError(f"N_DW: expected a multiple of taps = {k.taps}, got {a.N_DW}")
    positions = a.N_DW // k.taps
    if k.has_bias and a.C_OUT > positions:
        raise ValueError(f"C_OUT: expected at most N_DW / taps = {positions} (the programs of dw's positions "
                         f"also sum dbias), got {a.C_OUT}")
    row = a.N_DW + (a.C_OUT if k.has_bias else 0)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(N_DW [+ C_OUT with HAS_BIAS])")
    check_numel("dw", a.dw, a.N_DW, "N_DW")
    if k.has_bias:
        check_numel("dbias", a.dbias, a.C_OUT, "C_OUT")
    return check_grid(cdiv(positions, k.block))


@triton.jit
def _split_sum(partial, row_len, first_column, rows_of_columns, columns_ok, SPLIT,
               SPLIT_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 sum over s < SPLIT of partial[s, first_column + c] for the [BLOCK_R, BLOCK_C] columns c =
    rows_of_columns[r] + j (columns_ok masks them): SPLIT_ROWS rows loaded at once (loads in flight
    together, not one memory latency each), each group summed by the same tree every run and the
    groups added in split order."""
    total = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    split_rows = tl.arange(0, SPLIT_ROWS)
    columns = first_column + rows_of_columns[:, None] + tl.arange(0, BLOCK_C)[None, :]
    for first in range(0, SPLIT, SPLIT_ROWS):
        rows = first + split_rows
        ok = (rows < SPLIT)[:, None, None] & columns_ok[None, :, :]
        group = tl.load(partial + rows.to(tl.int64)[:, None, None] * row_len + columns[None, :, :], mask=ok,
                        other=0.0)
        total += tl.sum(group, axis=0)
    return total


@triton.jit
def conv2d_dw_reduce(partial, dw, dbias, SPLIT, N_DW, C_OUT, HAS_BIAS: tl.constexpr, TAPS: tl.constexpr,
                     TAP_BLOCK: tl.constexpr, SPLIT_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of the split partial gradients, in a fixed order; tap-major partials put in dw's order.

    A partial row holds N_DW = TAPS * P values, tap-major (j = tap*P + p; TAPS = KH*KW as the TMA
    dw writes them, TAPS = 1 for partials already in dw's order), then C_OUT bias sums when HAS_BIAS.
    Grid: (cdiv(P, BLOCK),). Program i takes the positions p in [i*BLOCK, (i+1)*BLOCK) and writes
        dw[p*TAPS + tap] = sum over s < SPLIT of partial[s, tap*P + p]   (every tap < TAPS <= TAP_BLOCK)
    and, when HAS_BIAS, dbias[p] = sum over s of partial[s, N_DW + p] for its p < C_OUT (P >= C_OUT).
    Sums in fp32, SPLIT_ROWS rows at a time in split order (`_split_sum`: the same order every run),
    rounded once. dw[p*TAPS + tap] is dw's [C_OUT, C_IN, KH, KW] order: a program's stores are one
    contiguous run (loads run along p, stores along taps), because stores of each tap's values TAPS
    apart write one memory sector per value (docs/notes.md, "Weight gradients: the pipeliner race and the
    reduce"). Every element of dw (and dbias) is written; dbias is not touched unless HAS_BIAS.
    """
    positions = N_DW // TAPS
    row_len = partial_row_length(N_DW, C_OUT, HAS_BIAS)
    first = tl.program_id(0) * BLOCK
    tap = tl.arange(0, TAP_BLOCK)
    p = first + tl.arange(0, BLOCK)
    ok = (tap < TAPS)[:, None] & (p < positions)[None, :]
    total = _split_sum(partial, row_len, first, tap * positions, ok, SPLIT, SPLIT_ROWS, TAP_BLOCK, BLOCK)
    tl.store(dw + p[None, :] * TAPS + tap[:, None], total.to(dw.dtype.element_ty), mask=ok)
    if HAS_BIAS:
        if first < C_OUT:
            bias_ok = (p < C_OUT)[None, :]
            bias = _split_sum(partial, row_len, N_DW + first, tl.zeros([1], dtype=tl.int32), bias_ok, SPLIT,
                              SPLIT_ROWS, 1, BLOCK)
            tl.store(dbias + p[None, :], bias.to(dbias.dtype.element_ty), mask=bias_ok)


Conv2dDwReduce = kernel_object(
    conv2d_dw_reduce,
    helpers=(_split_sum, partial_row_length),
    example=(False, 1, 1, 8, 1024),
    entry=conv2d_dw_reduce_entry,
    flags=("HAS_BIAS",),
    pointer_dtypes={"partial": torch.float32},
    num_stages=1,
)
