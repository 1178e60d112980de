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

from ...kernel import kernel_object
from ..common.checks import check_grid_3d, check_numel
from .checks import check_conv_launch
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row, split_slice
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot


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
    (programs of their own: `ops.common.tensor_core.sums_beside_dot` says why).
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
    slice_first, slice_end = split_slice(B * ohw, split, SPLIT, BLOCK_K)
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


Conv2dGemmDw = kernel_object(
    conv2d_gemm_dw,
    helpers=(conv_dot, split_slice, *PARTIAL_ROW_HELPERS),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, False, True, 64, 64, 64),
    entry=conv2d_gemm_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32"),
)
