"""Depthwise 2-D convolution (groups == C_IN == C_OUT), direct: forward, dx and dw kernels.

With one input channel per output channel the GEMM has K = KH*KW and N = 1, so tensor cores
would idle; the work is memory-bound and a direct stencil over each plane is the right shape.
dx is gathered (no atomics); dw is split over the batch into fp32 partial rows that
`Conv2dDwReduce` adds in a fixed order, so both are bitwise reproducible.
"""
import torch
import triton
import triton.language as tl

from ..kernel import kernel_object
from .checks import check_numel
from .conv2d_gemm_dw import dw_partial_size
from .conv2d_gemm_forward import check_conv_launch, check_grid_3d
from .host_math import cdiv


def _depthwise_sizes(a):
    """The launch's sizes under the names `check_conv_launch` expects (C_IN = C_OUT = C)."""
    names = dict(vars(a))
    names.update(C_IN=a.C, C_OUT=a.C)
    return type(a)(**names)


def conv2d_depthwise_forward_entry(k, a):
    """Grid (B*C, cdiv(OH*OW, BLOCK)) for `Conv2dDepthwiseForward`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    if k.has_bias:
        check_numel("bias", a.bias, a.C, "C")
    return check_grid_3d(a.B * a.C, cdiv(a.OH * a.OW, k.block), 1)


def conv2d_depthwise_dx_entry(k, a):
    """Grid (B*C, cdiv(H*W, BLOCK)) for `Conv2dDepthwiseDx`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    return check_grid_3d(a.B * a.C, cdiv(a.H * a.W, k.block), 1)


def conv2d_depthwise_dw_entry(k, a):
    """Grid (C, SPLIT) for `Conv2dDepthwiseDw`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    if k.block_taps < k.kh * k.kw:
        raise ValueError(f"block_taps: expected at least kh*kw = {k.kh * k.kw}, got {k.block_taps}")
    if a.SPLIT > a.B:
        raise ValueError(f"SPLIT: expected at most B = {a.B} slices of the batch, got {a.SPLIT}")
    row = dw_partial_size(a.C, 1, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C*KH*KW [+ C with HAS_BIAS])")
    return check_grid_3d(a.C, a.SPLIT, 1)


@triton.jit
def conv2d_depthwise_forward(
    x, w, bias, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Depthwise 2-D convolution forward, direct.

    Grid: (B*C, cdiv(OH*OW, BLOCK)). Program (b*C + c, t) writes y[b, c, oh, ow] for the BLOCK
    pixels oh*OW + ow of tile t:
        y = bias[c] + sum over (kh, kw) of w[c, 0, kh, kw] * x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H,
                                                              ow*STRIDE_W - PAD_W + kw*DIL_W],
    x read as 0 outside the image, fp32 accumulation, y rounded once; bias read only when HAS_BIAS.
    """
    plane = tl.program_id(0)
    c = plane % C
    pixel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pixel_ok = pixel < OH * OW
    ih_first = (pixel // OW) * STRIDE_H - PAD_H
    iw_first = (pixel % OW) * STRIDE_W - PAD_W
    x_plane = x + plane.to(tl.int64) * H * W
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            ih = ih_first + kh * DIL_H
            iw = iw_first + kw * DIL_W
            inside = pixel_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_values = tl.load(x_plane + ih * W + iw, mask=inside, other=0.0)
            acc += x_values.to(tl.float32) * tl.load(w + c * KH * KW + kh * KW + kw).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + c).to(tl.float32)
    tl.store(y + plane.to(tl.int64) * OH * OW + pixel, acc.to(y.dtype.element_ty), mask=pixel_ok)


@triton.jit
def conv2d_depthwise_dx(
    dy, w, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Depthwise 2-D convolution data gradient, direct gather (no atomics).

    Grid: (B*C, cdiv(H*W, BLOCK)). Program (b*C + c, t) writes dx[b, c, ih, iw] for the BLOCK
    pixels ih*W + iw of tile t:
        dx = sum over (kh, kw) of dy[b, c, oh, ow] * w[c, 0, kh, kw],
        oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H, ow = (iw + PAD_W - kw*DIL_W) / STRIDE_W,
    over the taps where both divisions are exact and (oh, ow) lies in dy. fp32 accumulation,
    dx rounded once; every element of dx is written.
    """
    plane = tl.program_id(0)
    c = plane % C
    pixel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pixel_ok = pixel < H * W
    ih = pixel // W
    iw = pixel % W
    dy_plane = dy + plane.to(tl.int64) * OH * OW
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            reach_h = ih + PAD_H - kh * DIL_H
            reach_w = iw + PAD_W - kw * DIL_W
            oh = reach_h // STRIDE_H
            ow = reach_w // STRIDE_W
            hit = pixel_ok & (reach_h >= 0) & (reach_w >= 0) & (oh < OH) & (ow < OW)
            hit = hit & (reach_h % STRIDE_H == 0) & (reach_w % STRIDE_W == 0)
            dy_values = tl.load(dy_plane + oh * OW + ow, mask=hit, other=0.0)
            tap = tl.load(w + c * KH * KW + kh * KW + kw).to(tl.float32)
            # Only taps that reach dy contribute: a NaN or Inf weight must not reach dx through padding.
            acc += tl.where(hit, dy_values.to(tl.float32) * tap, 0.0)
    tl.store(dx + plane.to(tl.int64) * H * W + pixel, acc.to(dx.dtype.element_ty), mask=pixel_ok)


@triton.jit
def conv2d_depthwise_dw(
    dy, x, partial, B, C, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_TAPS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Depthwise 2-D convolution weight gradient, one batch slice per program (no atomics).

    Grid: (C, SPLIT). Program (c, s) sums over the images b = s, s + SPLIT, s + 2*SPLIT, ... < B
    (in that order) and all their pixels (oh, ow), BLOCK at a time, and writes
        partial[s, c*KH*KW + kh*KW + kw] = sum of dy[b, c, oh, ow]
            * x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W]
    (x read as 0 outside the image) and, when HAS_BIAS, partial[s, C*KH*KW + c] = sum of dy[b, c, oh, ow].
    All KH*KW taps are one [BLOCK_TAPS, BLOCK] tile (BLOCK_TAPS >= KH*KW); sums in fp32.
    """
    c = tl.program_id(0)
    split = tl.program_id(1)
    taps: tl.constexpr = KH * KW
    tap = tl.arange(0, BLOCK_TAPS)
    tap_ok = tap < taps
    dh = (tap // KW) * DIL_H
    dw = (tap % KW) * DIL_W
    acc = tl.zeros([BLOCK_TAPS, BLOCK], dtype=tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(split, B, SPLIT):
        plane = c.to(tl.int64) + b * C
        for pixel_first in range(0, OH * OW, BLOCK):
            pixel = pixel_first + tl.arange(0, BLOCK)
            pixel_ok = pixel < OH * OW
            dy_values = tl.load(dy + plane * OH * OW + pixel, mask=pixel_ok, other=0.0).to(tl.float32)
            ih = ((pixel // OW) * STRIDE_H - PAD_H)[None, :] + dh[:, None]
            iw = ((pixel % OW) * STRIDE_W - PAD_W)[None, :] + dw[:, None]
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & tap_ok[:, None] & pixel_ok[None, :]
            x_values = tl.load(x + plane * H * W + ih * W + iw, mask=inside, other=0.0)
            acc += x_values.to(tl.float32) * dy_values[None, :]
            if HAS_BIAS:
                dbias += dy_values
    row_len = C * taps
    if HAS_BIAS:
        row_len += C
    row = partial + split.to(tl.int64) * row_len
    tl.store(row + c * taps + tap, tl.sum(acc, axis=1), mask=tap_ok)
    if HAS_BIAS:
        tl.store(row + C * taps + c, tl.sum(dbias, axis=0))


_GEOMETRY = (3, 3, 1, 1, 1, 1, 1, 1)
Conv2dDepthwiseForward = kernel_object(
    conv2d_depthwise_forward,
    example=_GEOMETRY + (False, 1024),
    entry=conv2d_depthwise_forward_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS",),
    num_warps=4,
    num_stages=2,
)
Conv2dDepthwiseDx = kernel_object(
    conv2d_depthwise_dx,
    example=_GEOMETRY + (1024,),
    entry=conv2d_depthwise_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    num_warps=4,
    num_stages=2,
)
Conv2dDepthwiseDw = kernel_object(
    conv2d_depthwise_dw,
    example=_GEOMETRY + (False, 16, 256),
    entry=conv2d_depthwise_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS",),
    num_warps=4,
    num_stages=2,
)
