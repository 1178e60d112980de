"""2-D convolution forward as an implicit GEMM on tensor cores: `Conv2dGemmForward`.

Per group g the convolution is the matrix product
    y[pixel, c_out] = sum over k of X[pixel, k] * Wt[k, c_out],   k = c_in_local * KH*KW + kh * KW + kw,
with pixel = (b, oh, ow) and X the im2col view of x, which is never built: each K-slice of X is
gathered from the NCHW tensor as it is needed. Flattening (c_in, kh, kw) into one K axis keeps
the tensor cores busy when C_IN/G is tiny (the 3-channel stem) as well as when it is large.
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid_3d, check_numel
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot

def conv2d_gemm_forward_entry(k, a):
    """Grid (pixel tiles, c_out tiles, G) for `Conv2dGemmForward`."""
    _, cout_per_group = check_conv_launch(k, a, k.g)
    if k.has_bias:
        check_numel("bias", a.bias, a.C_OUT, "C_OUT")
    return check_grid_3d(cdiv(a.B * a.OH * a.OW, k.block_m), cdiv(cout_per_group, k.block_n), k.g)


@triton.jit
def store_nchw_transposed(t, channel_offset, pixel_offset, acc, channel_ok, pixel_ok):
    """t[channel_offset[n] + pixel_offset[m]] = acc[m, n] in t's type, where channel_ok[n] & pixel_ok[m]: the NCHW
    implicit GEMMs' epilogue, their [pixels, channels] accumulator stored as [channels, pixels] so that the pixel
    axis, contiguous in NCHW, is the fastest one."""
    tl.store(
        t + channel_offset[:, None] + pixel_offset[None, :],
        tl.trans(acc).to(t.dtype.element_ty),
        mask=channel_ok[:, None] & pixel_ok[None, :],
    )


@triton.jit
def conv2d_gemm_forward(
    x, w, bias, y, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, G: tl.constexpr,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """2-D convolution forward, implicit GEMM with tl.dot (stride, padding, dilation, groups, bias).

    Grid: (cdiv(B*OH*OW, BLOCK_M), cdiv(C_OUT/G, BLOCK_N), G).
    Program (pm, pn, g) writes y[b, c_out, oh, ow] for the BLOCK_M pixels p = b*OH*OW + oh*OW + ow
    of tile pm and the BLOCK_N channels c_out = g*(C_OUT/G) + n of tile pn:
        y = bias[c_out] + sum over (c_in_local, kh, kw) of w[c_out, c_in_local, kh, kw]
            * x[b, g*(C_IN/G) + c_in_local, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W],
    x read as 0 outside the image; the sum runs over K = (C_IN/G)*KH*KW in BLOCK_K slices.
    Products on tensor cores (`conv_dot`: fp32 as TF32 or tf32x3), accumulation in fp32,
    y rounded once. Every element of y is written; bias is read only when HAS_BIAS.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.program_id(2)
    cin_per_group = C_IN // G
    cout_per_group = C_OUT // G
    taps: tl.constexpr = KH * KW
    k_total = cin_per_group * taps
    ohw = OH * OW
    pixel = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pixel_ok = pixel < B * ohw
    b = pixel // ohw
    pixel_in_image = pixel % ohw
    ih_first = (pixel_in_image // OW) * STRIDE_H - PAD_H
    iw_first = (pixel_in_image % OW) * STRIDE_W - PAD_W
    # Offset of x[b, first channel of the group, ih_first, iw_first]; may point before the image where
    # the window starts in the padding, but those elements are masked.
    x_pixel = (b.to(tl.int64) * C_IN + group * cin_per_group) * H * W + ih_first * W + iw_first
    # ih = ih_first + dh lies in [0, H) iff -ih_first <= dh < H - ih_first: the masks below compare a
    # row with a column instead of forming [K, pixels] sums.
    dh_low, dh_high = -ih_first, H - ih_first
    dw_low, dw_high = -iw_first, W - iw_first
    c_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_out_ok = c_out < cout_per_group
    w_rows = (group * cout_per_group + c_out).to(tl.int64) * k_total
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_first in range(0, k_total, BLOCK_K):
        k = k_first + tl.arange(0, BLOCK_K)
        k_ok = k < k_total
        c_in_local = k // taps
        dh = ((k % taps) // KW) * DIL_H
        dw = (k % KW) * DIL_W
        inside = (dh[:, None] >= dh_low[None, :]) & (dh[:, None] < dh_high[None, :])
        inside &= (dw[:, None] >= dw_low[None, :]) & (dw[:, None] < dw_high[None, :])
        inside &= k_ok[:, None] & pixel_ok[None, :]
        # Tiles are [K, pixels] so that the pixel axis, contiguous in NCHW, is the fastest one.
        x_tile = tl.load(x + x_pixel[None, :] + (c_in_local * H * W + dh * W + dw)[:, None], mask=inside, other=0.0)
        w_tile = tl.load(w + w_rows[:, None] + k[None, :], mask=c_out_ok[:, None] & k_ok[None, :], other=0.0)
        acc = conv_dot(tl.trans(x_tile), tl.trans(w_tile), acc, TF32)
    if HAS_BIAS:
        bias_values = tl.load(bias + group * cout_per_group + c_out, mask=c_out_ok, other=0.0)
        acc += bias_values.to(tl.float32)[None, :]
    y_pixel = b.to(tl.int64) * C_OUT * ohw + pixel_in_image
    y_channel = (group * cout_per_group + c_out).to(tl.int64) * ohw
    store_nchw_transposed(y, y_channel, y_pixel, acc, c_out_ok, pixel_ok)


Conv2dGemmForward = kernel_object(
    conv2d_gemm_forward,
    helpers=(conv_dot, store_nchw_transposed),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, False, True, 128, 64, 32),
    entry=conv2d_gemm_forward_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32"),
)
