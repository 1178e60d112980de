"""2-D convolution forward for few input channels, one output row at a time: `Conv2dRowsForward`.

With C_IN <= 4 (the RGB stem: 3 -> 64, 7x7, stride 2 @224) the reduction K = C_IN*KH*KW is short and
the general implicit GEMM (`Conv2dGemmForward`) spends its time forming a [K, pixels] gather: per element
int64 offsets and four range checks of (kh, kw) against the pixel's window. Here a program owns pixels of
one output row, so all its windows start on the same input row: K runs over input rows (c_in, kh), each
KW taps wide (padded to the power of two KW_SPAN), the row check is one per K element, the column check
one per element, and offsets within an image are int32.
"""
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_grid, check_numel
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot, tf32_rounded


def conv2d_rows_forward_entry(k, a):
    """Grid (B * OH * cdiv(OW, block_m), cdiv(C_OUT, block_n)) for `Conv2dRowsForward`."""
    if k.kw_span < k.kw or k.kw_span & (k.kw_span - 1):
        raise ValueError(f"kw_span: expected a power of two >= kw = {k.kw}, got {k.kw_span}")
    if k.block_k % k.kw_span:
        raise ValueError(f"block_k: expected a multiple of kw_span = {k.kw_span}, got {k.block_k}")
    check_conv_launch(k, a, 1)
    if k.has_bias:
        check_numel("bias", a.bias, a.C_OUT, "C_OUT")
    for name, per_image in (("x", a.C_IN * a.H * a.W), ("y", a.C_OUT * a.OH * a.OW)):
        if per_image > INT32_MAX:
            raise ValueError(f"{name}: expected fewer than 2**31 elements per image (int32 offsets), got {per_image}")
    return (check_grid(a.B * a.OH * cdiv(a.OW, k.block_m))[0], cdiv(a.C_OUT, k.block_n), 1)


@triton.jit
def conv2d_rows_forward(
    x, w, bias, y, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KW_SPAN: tl.constexpr,
):
    """2-D convolution forward (one group; stride, padding, dilation, bias) over output rows.

    Grid: (B * OH * cdiv(OW, BLOCK_M), cdiv(C_OUT, BLOCK_N)).
    Program (p, pn), p = (b * OH + oh) * cdiv(OW, BLOCK_M) + tile, writes y[b, c_out, oh, ow] for the
    BLOCK_M columns ow of the tile and the BLOCK_N channels c_out of tile pn:
        y = bias[c_out] + sum over (c_in, kh, kw) of w[c_out, c_in, kh, kw]
            * x[b, c_in, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W],
    x read as 0 outside the image. K runs over input rows r = c_in*KH + kh, ROWS = BLOCK_K / KW_SPAN of them a
    slice: element i of slice j is row j*ROWS + i // KW_SPAN at tap kw = i % KW_SPAN (taps >= KW and rows
    >= C_IN*KH read as 0). Products on tensor cores, fp32 x as TF32 rounded to nearest when TF32 (the x
    tile is the register operand) or tf32x3; accumulation in fp32, y rounded once. Every element of y is
    written; bias is read only when HAS_BIAS. Contract: KW_SPAN a power of two >= KW, BLOCK_K a multiple.
    """
    col_tiles = tl.cdiv(OW, BLOCK_M)
    row = tl.program_id(0) // col_tiles  # b * OH + oh
    b = row // OH
    oh = row % OH
    ow = (tl.program_id(0) % col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_out_ok = c_out < C_OUT
    x_image = x + b.to(tl.int64) * C_IN * H * W
    ih_first = oh * STRIDE_H - PAD_H
    iw_first = ow * STRIDE_W - PAD_W
    ROWS: tl.constexpr = BLOCK_K // KW_SPAN
    i = tl.arange(0, BLOCK_K)
    kw = i % KW_SPAN
    tap_ok = kw < KW
    rows_total = C_IN * KH
    iw = iw_first[:, None] + (kw * DIL_W)[None, :]  # [pixels, K]
    column_ok = (iw >= 0) & (iw < W) & tap_ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for row_first in range(0, rows_total, ROWS):
        r = row_first + i // KW_SPAN
        ih = ih_first + (r % KH) * DIL_H
        row_ok = (r < rows_total) & (ih >= 0) & (ih < H)
        # Columns outside [0, OW) read real pixels of the row or masked ones; they are never stored.
        x_tile = tl.load(x_image + ((r // KH) * H + ih)[None, :] * W + iw, mask=column_ok & row_ok[None, :],
                         other=0.0)
        w_tile = tl.load(w + c_out[None, :] * rows_total * KW + (r * KW + kw)[:, None],
                         mask=c_out_ok[None, :] & (tap_ok & (r < rows_total))[:, None], other=0.0)
        if x_tile.dtype == tl.float32 and TF32:
            acc = tl.dot(tf32_rounded(x_tile), w_tile, acc, input_precision="tf32")
        else:
            acc = conv_dot(x_tile, w_tile, acc, TF32)
    if HAS_BIAS:
        acc += tl.load(bias + c_out, mask=c_out_ok, other=0.0).to(tl.float32)[None, :]
    y_image = y + b.to(tl.int64) * C_OUT * OH * OW
    tl.store(y_image + c_out[None, :] * (OH * OW) + (oh * OW + ow)[:, None], acc.to(y.dtype.element_ty),
             mask=c_out_ok[None, :] & (ow < OW)[:, None])


Conv2dRowsForward = kernel_object(
    conv2d_rows_forward,
    helpers=(conv_dot, tf32_rounded),
    example=(7, 7, 2, 2, 3, 3, 1, 1, False, True, 64, 64, 16, 8),
    entry=conv2d_rows_forward_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32"),
)
