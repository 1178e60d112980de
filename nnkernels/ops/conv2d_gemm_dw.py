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


def conv2d_gemm_dw_entry(k, a):
    """Grid (c_out tiles * n tiles, SPLIT, G) for `Conv2dGemmDw`."""
    cin_per_group, cout_per_group = check_conv_launch(k, a, k.g)
    if a.SPLIT > a.B * a.OH * a.OW:
        raise ValueError(f"SPLIT: expected at most B*OH*OW = {a.B * a.OH * a.OW} slices, got {a.SPLIT}")
    row = dw_partial_size(a.C_OUT, cin_per_group, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C_OUT*(C_IN/G)*KH*KW [+ C_OUT with HAS_BIAS])")
    tiles = cdiv(cout_per_group, k.block_m) * cdiv(cin_per_group * k.kh * k.kw, k.block_n)
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

    Grid: (cdiv(C_OUT/G, BLOCK_M) * cdiv((C_IN/G)*KH*KW, BLOCK_N), SPLIT, G).
    Program (tile, s, g) takes the pixels p = b*OH*OW + oh*OW + ow in slice s, [s*L, min((s+1)*L, B*OH*OW))
    with L = cdiv(cdiv(B*OH*OW, SPLIT), BLOCK_K)*BLOCK_K, and writes, for its BLOCK_M channels
    c_out = g*(C_OUT/G) + m and BLOCK_N columns n = c_in_local*KH*KW + kh*KW + kw,
        partial[s, c_out*(C_IN/G)*KH*KW + n] = sum over p of dy[b, c_out, oh, ow]
            * x[b, g*(C_IN/G) + c_in_local, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W]
    (x read as 0 outside the image) and, when HAS_BIAS, the programs of the first n tile also write
        partial[s, C_OUT*(C_IN/G)*KH*KW + c_out] = sum over p of dy[b, c_out, oh, ow].
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
    tile_m = pid_tile // num_n_tiles
    tile_n = pid_tile % num_n_tiles
    c_out = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c_out_ok = c_out < cout_per_group
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_total
    c_in_local = n // taps
    dh = ((n % taps) // KW) * DIL_H
    dw = (n % KW) * DIL_W
    x_column = (group * cin_per_group + c_in_local) * H * W + dh * W + dw
    ohw = OH * OW
    pixels = B * ohw
    slice_len = tl.cdiv(tl.cdiv(pixels, SPLIT), BLOCK_K) * BLOCK_K
    slice_first = split * slice_len
    slice_end = tl.minimum(slice_first + slice_len, pixels)
    dy_channel = (group * cout_per_group + c_out) * ohw
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p_first in range(slice_first, slice_end, BLOCK_K):
        p = p_first + tl.arange(0, BLOCK_K)
        p_ok = p < slice_end
        b = p // ohw
        p_in_image = p % ohw
        ih_first = (p_in_image // OW) * STRIDE_H - PAD_H
        iw_first = (p_in_image % OW) * STRIDE_W - PAD_W
        dy_pixel = b.to(tl.int64) * C_OUT * ohw + p_in_image
        dy_tile = tl.load(
            dy + dy_channel[:, None] + dy_pixel[None, :], mask=c_out_ok[:, None] & p_ok[None, :], other=0.0
        )
        # ih = ih_first + dh lies in [0, H) iff -ih_first <= dh < H - ih_first: row-column compares.
        inside = (dh[:, None] >= -ih_first[None, :]) & (dh[:, None] < (H - ih_first)[None, :])
        inside &= (dw[:, None] >= -iw_first[None, :]) & (dw[:, None] < (W - iw_first)[None, :])
        inside &= n_ok[:, None] & p_ok[None, :]
        x_pixel = b.to(tl.int64) * C_IN * H * W + ih_first * W + iw_first
        # [n, pixels]: the pixel axis, contiguous in NCHW, is the fastest one.
        x_tile = tl.load(x + x_column[:, None] + x_pixel[None, :], mask=inside, other=0.0)
        acc = conv_dot(dy_tile, tl.trans(x_tile), acc, TF32)
        if HAS_BIAS:
            dbias += tl.sum(dy_tile.to(tl.float32), axis=1)
    row_len = C_OUT * n_total
    if HAS_BIAS:
        row_len += C_OUT
    row = partial + split.to(tl.int64) * row_len
    w_index = (group * cout_per_group + c_out)[:, None] * n_total + n[None, :]
    tl.store(row + w_index, acc, mask=c_out_ok[:, None] & n_ok[None, :])
    if HAS_BIAS:
        if tile_n == 0:
            tl.store(row + C_OUT * n_total + group * cout_per_group + c_out, dbias, mask=c_out_ok)


def conv2d_dw_reduce_entry(k, a):
    """Grid (cdiv(N_DW [+ C_OUT with HAS_BIAS], BLOCK),) for `Conv2dDwReduce`."""
    if k.split_rows & (k.split_rows - 1):
        raise ValueError(f"split_rows: expected a power of two, got {k.split_rows}")
    if a.N_DW % k.taps:
        raise ValueError(f"N_DW: expected a multiple of taps = {k.taps}, got {a.N_DW}")
    row = a.N_DW + (a.C_OUT if k.has_bias else 0)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(N_DW [+ C_OUT with HAS_BIAS])")
    check_numel("dw", a.dw, a.N_DW, "N_DW")
    if k.has_bias:
        check_numel("dbias", a.dbias, a.C_OUT, "C_OUT")
    return check_grid(cdiv(row, k.block))


@triton.jit
def conv2d_dw_reduce(partial, dw, dbias, SPLIT, N_DW, C_OUT, HAS_BIAS: tl.constexpr, TAPS: tl.constexpr,
                     SPLIT_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of the split partial gradients, in a fixed order; tap-major partials put in dw's order.

    Grid: (cdiv(R, BLOCK),), R = N_DW (+ C_OUT when HAS_BIAS) the length of one partial row.
    Program i takes the BLOCK columns j of its tile and forms total[j], the fp32 sum over the SPLIT
    rows of partial[s, j]: SPLIT_ROWS rows at a time (loads in flight together: one row at a time
    waited on memory for each), each group summed by the same tree every run and the groups added in
    split order; rounded once. With TAPS = 1 the partials are in dw's order, dw[j] = total[j]; with
    TAPS = KH*KW they are tap-major (j = tap*P + c_out*C_IN + c_in, P = N_DW/TAPS, as the TMA dw
    writes them) and dw[(j mod P)*TAPS + j div P] = total[j], dw's [C_OUT, C_IN, KH, KW] order.
    When HAS_BIAS, dbias[j - N_DW] = total[j] for j >= N_DW. Every element of dw (and dbias) is
    written; dbias is not touched unless HAS_BIAS.
    """
    row_len = N_DW
    if HAS_BIAS:
        row_len += C_OUT
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j_ok = j < row_len
    total = tl.zeros([BLOCK], dtype=tl.float32)
    split_rows = tl.arange(0, SPLIT_ROWS)
    for first in range(0, SPLIT, SPLIT_ROWS):
        rows = first + split_rows
        ok = (rows < SPLIT)[:, None] & j_ok[None, :]
        group = tl.load(partial + rows.to(tl.int64)[:, None] * row_len + j[None, :], mask=ok, other=0.0)
        total += tl.sum(group, axis=0)
    if TAPS == 1:
        dw_index = j
    else:
        plane = N_DW // TAPS
        dw_index = (j % plane) * TAPS + j // plane
    tl.store(dw + dw_index, total.to(dw.dtype.element_ty), mask=j < N_DW)
    if HAS_BIAS:
        tl.store(dbias + (j - N_DW), total.to(dbias.dtype.element_ty), mask=j_ok & (j >= N_DW))


Conv2dGemmDw = kernel_object(
    conv2d_gemm_dw,
    helpers=(conv_dot,),
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
    example=(False, 1, 8, 1024),
    entry=conv2d_dw_reduce_entry,
    flags=("HAS_BIAS",),
    pointer_dtypes={"partial": torch.float32},
    num_warps=4,
    num_stages=1,
)
