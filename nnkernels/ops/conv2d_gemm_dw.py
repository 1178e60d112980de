"""2-D convolution weight (and bias) gradient as an implicit GEMM, split over pixels, without atomics.

`Conv2dGemmDw`: per group, dw[c_out, n] = sum over pixels of dy[pixel, c_out] * X[pixel, n] with
n = c_in_local*KH*KW + kh*KW + kw (dw's own memory order) and X the im2col view of x. The
reduction over B*OH*OW pixels is long and the output small, so SPLIT programs per output tile
each sum one slice of the pixels into their own row of an fp32 `partial` buffer.
`Conv2dDwReduce` then adds the SPLIT rows in a fixed order and rounds once: run to run, the
same additions in the same order, so dw is bitwise reproducible.
"""
import torch
import triton
import triton.language as tl

from ..kernel import kernel_object
from .checks import check_grid, check_numel
from .conv2d_gemm_forward import check_conv_launch, check_grid_3d
from .host_math import cdiv
from .tensor_core import conv_dot


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


def conv2d_gemm_dw_entry(k, a):
    """Grid (c_out tiles * (n tiles + has_bias), SPLIT, G) for `Conv2dGemmDw`."""
    cin_per_group, cout_per_group = check_conv_launch(k, a, k.g)
    if a.SPLIT > a.B * a.OH * a.OW:
        raise ValueError(f"SPLIT: expected at most B*OH*OW = {a.B * a.OH * a.OW} slices, got {a.SPLIT}")
    row = dw_partial_size(a.C_OUT, cin_per_group, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C_OUT*(C_IN/G)*KH*KW [+ C_OUT with HAS_BIAS])")
    m_tiles = cdiv(cout_per_group, k.block_m)
    tiles = m_tiles * cdiv(cin_per_group * k.kh * k.kw, k.block_n) + (m_tiles if k.has_bias else 0)
    return check_grid_3d(tiles, a.SPLIT, k.g)


@triton.jit
def conv2d_gemm_dw(
    dy, x, partial, B, C_IN, C_OUT, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, G: tl.constexpr,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """2-D convolution weight gradient, one pixel slice per program, implicit GEMM with tl.dot.

    Grid: (M * cdiv((C_IN/G)*KH*KW, BLOCK_N) + (M when HAS_BIAS), SPLIT, G), M = cdiv(C_OUT/G, BLOCK_M).
    Program (tile, s, g) takes the pixels p = b*OH*OW + oh*OW + ow in slice s, [s*L, min((s+1)*L, B*OH*OW))
    with L = cdiv(cdiv(B*OH*OW, SPLIT), BLOCK_K)*BLOCK_K. A product tile (tile < M * n tiles) writes, for its
    BLOCK_M channels c_out = g*(C_OUT/G) + m and BLOCK_N columns n = c_in_local*KH*KW + kh*KW + kw,
        partial[s, c_out*(C_IN/G)*KH*KW + n] = sum over p of dy[b, c_out, oh, ow]
            * x[b, g*(C_IN/G) + c_in_local, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W]
    (x read as 0 outside the image); with HAS_BIAS, the M programs after them write, for their BLOCK_M channels,
        partial[s, C_OUT*(C_IN/G)*KH*KW + c_out] = sum over p of dy[b, c_out, oh, ow]
    (programs of their own: `ops.tensor_core.sums_beside_dot` says why).
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 sums. Every element of `partial` is written.
    """
    pid_tile = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2)
    cin_per_group = C_IN // G
    cout_per_group = C_OUT // G
    taps: tl.constexpr = KH * KW
    n_total = cin_per_group * taps
    num_n_tiles = tl.cdiv(n_total, BLOCK_N)
    product_tiles = tl.cdiv(cout_per_group, BLOCK_M) * num_n_tiles
    ohw = OH * OW
    pixels = B * ohw
    slice_len = tl.cdiv(tl.cdiv(pixels, SPLIT), BLOCK_K) * BLOCK_K
    slice_first = split * slice_len
    slice_end = tl.minimum(slice_first + slice_len, pixels)
    row = partial_row(partial, split, C_OUT * n_total, C_OUT, HAS_BIAS)
    if pid_tile < product_tiles:
        c_out = (pid_tile // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        c_out_ok = c_out < cout_per_group
        n = (pid_tile % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_total
        c_in_local = n // taps
        dh = ((n % taps) // KW) * DIL_H
        dw = (n % KW) * DIL_W
        x_column = (group * cin_per_group + c_in_local) * H * W + dh * W + dw
        dy_channel = (group * cout_per_group + c_out) * ohw
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p_first in range(slice_first, slice_end, BLOCK_K):
            p = p_first + tl.arange(0, BLOCK_K)
            p_ok = p < slice_end
            b = p // ohw
            p_in_image = p % ohw
            ih_first = (p_in_image // OW) * STRIDE_H - PAD_H
            iw_first = (p_in_image % OW) * STRIDE_W - PAD_W
            dy_pixel = b.to(tl.int64) * C_OUT * ohw + p_in_image
            dy_tile = tl.load(dy + dy_channel[:, None] + dy_pixel[None, :], mask=c_out_ok[:, None] & p_ok[None, :],
                              other=0.0)
            # ih = ih_first + dh lies in [0, H) iff -ih_first <= dh < H - ih_first: row-column compares.
            inside = (dh[:, None] >= -ih_first[None, :]) & (dh[:, None] < (H - ih_first)[None, :])
            inside &= (dw[:, None] >= -iw_first[None, :]) & (dw[:, None] < (W - iw_first)[None, :])
            inside &= n_ok[:, None] & p_ok[None, :]
            x_pixel = b.to(tl.int64) * C_IN * H * W + ih_first * W + iw_first
            # [n, pixels]: the pixel axis, contiguous in NCHW, is the fastest one.
            x_tile = tl.load(x + x_column[:, None] + x_pixel[None, :], mask=inside, other=0.0)
            acc = conv_dot(dy_tile, tl.trans(x_tile), acc, TF32)
        w_index = (group * cout_per_group + c_out)[:, None] * n_total + n[None, :]
        tl.store(row + w_index, acc, mask=c_out_ok[:, None] & n_ok[None, :])
    elif HAS_BIAS:
        c_out = (pid_tile - product_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        c_out_ok = c_out < cout_per_group
        dy_channel = (group * cout_per_group + c_out) * ohw
        dbias = tl.zeros([BLOCK_M], dtype=tl.float32)
        for p_first in range(slice_first, slice_end, BLOCK_K):
            p = p_first + tl.arange(0, BLOCK_K)
            dy_pixel = (p // ohw).to(tl.int64) * C_OUT * ohw + p % ohw
            dy_tile = tl.load(dy + dy_channel[:, None] + dy_pixel[None, :],
                              mask=c_out_ok[:, None] & (p < slice_end)[None, :], other=0.0)
            dbias += tl.sum(dy_tile.to(tl.float32), axis=1)
        tl.store(row + C_OUT * n_total + group * cout_per_group + c_out, dbias, mask=c_out_ok)


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
    contiguous run (loads run along p, stores along taps). On the H200 a reduce that stored each
    tap's values TAPS apart took 18.7 us for ResNet-50's 512-channel bf16 dw in one split, this one
    10.1 us. Every element of dw (and dbias) is written; dbias is not touched unless HAS_BIAS.
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


Conv2dGemmDw = kernel_object(
    conv2d_gemm_dw,
    helpers=(conv_dot, *PARTIAL_ROW_HELPERS),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, False, True, 64, 64, 64),
    entry=conv2d_gemm_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32"),
    num_warps=4,
    num_stages=3,
)
Conv2dDwReduce = kernel_object(
    conv2d_dw_reduce,
    helpers=(_split_sum, partial_row_length),
    example=(False, 1, 1, 8, 1024),
    entry=conv2d_dw_reduce_entry,
    flags=("HAS_BIAS",),
    pointer_dtypes={"partial": torch.float32},
    num_warps=4,
    num_stages=1,
)
