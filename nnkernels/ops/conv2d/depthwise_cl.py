"""Depthwise 2-D convolution (groups == C_IN == C_OUT) on channels-last tensors, direct: forward, dx and dw.

x, y, dy and dx are NHWC arrays ([B, H, W, C], a channels-last tensor's storage); the weight is [C, 1, KH, KW] as
torch stores it. A program takes BLOCK_P pixels (b, row, column, numbered in that order) by BLOCK_C channels: every
load and store is BLOCK_C consecutive channels of a pixel, so a channel block reads whole runs of memory with no
layout copy, as vectors where C_ALIGN (a power of two dividing C, at most 16 bytes of channels:
`host_math.channel_alignment`) says each pixel's channels start on an aligned address. The kernel rows are a loop
the compiler keeps, the taps of a row unrolled: every tap of a 5x5 window unrolled spilled registers. dx gathers (no
atomics); dw is split over pixel blocks into the fp32 partial rows `Conv2dDwReduce` adds in a fixed order, so both
are bitwise reproducible."""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_channel_alignment, check_grid_3d, check_numel
from ..common.host_math import cdiv
from ..common.tiles import channel_block, columns_in, load_nhwc, nhwc_pixels, nhwc_row, store_nhwc, zero_tiles
from .checks import check_conv_launch
from .depthwise import _depthwise_sizes
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row


def _check_channels(k, a):
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    check_channel_alignment(k.c_align, a.C)


def conv2d_depthwise_cl_forward_entry(k, a):
    """Grid (cdiv(B*OH*OW, BLOCK_P), cdiv(C, BLOCK_C)) for `Conv2dDepthwiseClForward`."""
    _check_channels(k, a)
    if k.has_bias:
        check_numel("bias", a.bias, a.C, "C")
    return check_grid_3d(cdiv(a.B * a.OH * a.OW, k.block_p), cdiv(a.C, k.block_c), 1)


def conv2d_depthwise_cl_dx_entry(k, a):
    """Grid (cdiv(B*H*W, BLOCK_P), cdiv(C, BLOCK_C)) for `Conv2dDepthwiseClDx`."""
    _check_channels(k, a)
    return check_grid_3d(cdiv(a.B * a.H * a.W, k.block_p), cdiv(a.C, k.block_c), 1)


def conv2d_depthwise_cl_dw_entry(k, a):
    """Grid (cdiv(C, BLOCK_C), SPLIT) for `Conv2dDepthwiseClDw`."""
    _check_channels(k, a)
    blocks = cdiv(a.B * a.OH * a.OW, k.block_p)
    if a.SPLIT > blocks:
        raise ValueError(f"SPLIT: expected at most the {blocks} pixel blocks cdiv(B*OH*OW, BLOCK_P), got {a.SPLIT}")
    row = dw_partial_size(a.C, 1, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C*KH*KW [+ C with HAS_BIAS])")
    return check_grid_3d(cdiv(a.C, k.block_c), a.SPLIT, 1)


@triton.jit
def _pixel_channel_block(B, ROWS, COLS, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr):
    """Program (i, j)'s block of an NHWC array [B, ROWS, COLS, C]: pixels q = i*BLOCK_P + ... (`nhwc_pixels`,
    q = (b*ROWS + row)*COLS + col) by channels c = j*BLOCK_C + ...: (q, b, row, col, q < B*ROWS*COLS, c, c < C),
    the last compared a C_ALIGN group at a time (`columns_in`)."""
    q, b, row, col = nhwc_pixels(tl.program_id(0), ROWS, COLS, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return q, b, row, col, q < B * ROWS * COLS, c, columns_in(c, C, C_ALIGN)


@triton.jit
def conv2d_depthwise_cl_forward(
    x, w, bias, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Depthwise 2-D convolution forward, channels-last.

    Grid: (cdiv(B*OH*OW, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for output pixels
    q = i*BLOCK_P + ... (q = (b*OH + oh)*OW + ow) and channels c = j*BLOCK_C + ...,
        y[q, c] = sum over (kh, kw) of x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c]
            * w[c, 0, kh, kw]  (+ bias[c] when HAS_BIAS),
    x read as 0 outside the image. Sums in fp32; every y is written.
    """
    q, b, oh, ow, q_ok, c, c_ok = _pixel_channel_block(B, OH, OW, C, BLOCK_P, BLOCK_C, C_ALIGN)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for kh in range(KH):
        for kw in tl.static_range(KW):
            xv = load_nhwc(x, b, oh * STRIDE_H - PAD_H + kh * DIL_H, ow * STRIDE_W - PAD_W + kw * DIL_W, c, H, W, C,
                           q_ok, c_ok, C_ALIGN)
            wv = tl.load(w + c * (KH * KW) + (kh * KW + kw), mask=c_ok, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    store_nhwc(y, q, c, C, acc, q_ok, c_ok, C_ALIGN)


Conv2dDepthwiseClForward = kernel_object(
    conv2d_depthwise_cl_forward,
    example=(3, 3, 1, 1, 1, 1, 1, 1, False, 32, 64, 8),
    entry=conv2d_depthwise_cl_forward_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS",),
    helpers=(_pixel_channel_block, nhwc_pixels, columns_in, nhwc_row, load_nhwc, store_nhwc),
)


@triton.jit
def conv2d_depthwise_cl_dx(
    dy, w, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Depthwise 2-D convolution input gradient, channels-last, gathered (no atomics).

    Grid: (cdiv(B*H*W, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for input pixels
    q = i*BLOCK_P + ... (q = (b*H + ih)*W + iw) and channels c = j*BLOCK_C + ...,
        dx[q, c] = sum over (kh, kw) of dy[b, oh, ow, c] * w[c, 0, kh, kw]
    over the taps with oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H whole and 0 <= oh < OH (likewise ow).
    Sums in fp32; every dx is written.
    """
    q, b, ih, iw, q_ok, c, c_ok = _pixel_channel_block(B, H, W, C, BLOCK_P, BLOCK_C, C_ALIGN)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for kh in range(KH):
        th = ih + PAD_H - kh * DIL_H
        oh = th // STRIDE_H
        # th < 0 gives no window: its quotient, rounded either way, is negative or misses th, masked off.
        for kw in tl.static_range(KW):
            tw = iw + PAD_W - kw * DIL_W
            ow = tw // STRIDE_W
            dyv = load_nhwc(dy, b, oh, ow, c, OH, OW, C, q_ok & (oh * STRIDE_H == th) & (ow * STRIDE_W == tw), c_ok,
                            C_ALIGN)
            wv = tl.load(w + c * (KH * KW) + (kh * KW + kw), mask=c_ok, other=0.0)
            acc += dyv.to(tl.float32) * wv.to(tl.float32)[None, :]
    store_nhwc(dx, q, c, C, acc, q_ok, c_ok, C_ALIGN)


Conv2dDepthwiseClDx = kernel_object(
    conv2d_depthwise_cl_dx,
    example=(3, 3, 1, 1, 1, 1, 1, 1, 32, 64, 8),
    entry=conv2d_depthwise_cl_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    helpers=(_pixel_channel_block, nhwc_pixels, columns_in, nhwc_row, load_nhwc, store_nhwc),
)


@triton.jit
def conv2d_depthwise_cl_dw(
    dy, x, partial, B, C, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Depthwise 2-D convolution weight gradient, channels-last, split over pixel blocks (no atomics).

    Grid: (cdiv(C, BLOCK_C), SPLIT). Program (j, s) takes channels c = j*BLOCK_C + ... and the output pixel
    blocks s, s + SPLIT, s + 2*SPLIT, ... of BLOCK_P pixels (q = (b*OH + oh)*OW + ow), in that order, and writes
        partial[s, c*KH*KW + kh*KW + kw] = sum over its pixels of dy[q, c]
            * x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c]
    (x read as 0 outside the image) and, when HAS_BIAS, partial[s, C*KH*KW + c] = sum of dy[q, c]. Sums in
    fp32: for each kernel row kh in turn, each block's [BLOCK_P, BLOCK_C] products summed over its pixels into
    one [BLOCK_C] row per tap of the row.
    """
    c, c_ok = channel_block(tl.program_id(0), C, BLOCK_C, C_ALIGN)
    split = tl.program_id(1)
    pixels = B * OH * OW
    row = partial_row(partial, split, C * KH * KW, C, HAS_BIAS)
    # One kernel row at a time, dy read again for each: the sums of all KH*KW taps at once outgrew the registers.
    for kh in range(KH):
        sums = zero_tiles(KW, 1, BLOCK_C)
        bias_sum = tl.zeros([1, BLOCK_C], dtype=tl.float32)
        for block in range(split, tl.cdiv(pixels, BLOCK_P), SPLIT):
            q, b, oh, ow = nhwc_pixels(block, OH, OW, BLOCK_P)
            q_ok = q < pixels
            out = nhwc_row(q, C, C_ALIGN)
            dyv = tl.load(dy + out[:, None] + c[None, :], mask=q_ok[:, None] & c_ok[None, :], other=0.0)
            dyv = dyv.to(tl.float32)
            bias_sum += tl.sum(dyv, axis=0)[None, :]
            new_sums = ()
            for kw in tl.static_range(KW):
                xv = load_nhwc(x, b, oh * STRIDE_H - PAD_H + kh * DIL_H, ow * STRIDE_W - PAD_W + kw * DIL_W, c, H, W,
                               C, q_ok, c_ok, C_ALIGN)
                new_sums = new_sums + (sums[kw] + tl.sum(dyv * xv.to(tl.float32), axis=0)[None, :],)
            sums = new_sums
        for kw in tl.static_range(KW):
            tl.store(row + c[None, :] * (KH * KW) + (kh * KW + kw), sums[kw], mask=c_ok[None, :])
        if HAS_BIAS and kh == 0:
            tl.store(row + C * KH * KW + c[None, :], bias_sum, mask=c_ok[None, :])


Conv2dDepthwiseClDw = kernel_object(
    conv2d_depthwise_cl_dw,
    example=(3, 3, 1, 1, 1, 1, 1, 1, False, 32, 64, 8),
    entry=conv2d_depthwise_cl_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS",),
    helpers=(channel_block, columns_in, nhwc_pixels, nhwc_row, load_nhwc, zero_tiles, *PARTIAL_ROW_HELPERS),
)
