"""2-D average pooling on channels-last tensors, forward and a gather backward: `AvgPool2dClForward`,
`AvgPool2dClBackward`, with all of `torch.nn.functional.avg_pool2d`'s options (divisors as `gather.py`'s module
docstring defines them).

x, y, dy and dx are NHWC arrays ([B, H, W, C], a channels-last tensor's storage). A program takes BLOCK_P pixels
(b, row, column, numbered in that order) by BLOCK_C channels, so every load and store is a run of consecutive
channels of one pixel (as vectors: C_ALIGN, `host_math.channel_alignment`): no layout copy either way. The
backward gathers (no atomics, deterministic, every dx
written)."""
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_channel_alignment, check_grid_3d
from ..common.host_math import cdiv
from ..common.tiles import columns_in, load_nhwc, nhwc_pixels, nhwc_row, store_nhwc
from .gather import check_pooled_tensors, check_window


def avg_pool2d_cl_entry(k, a):
    """Check a channels-last pooling launch and return its grid (cdiv(B*rows*cols, BLOCK_P), cdiv(C, BLOCK_C)) over
    the pixels it writes (OH x OW for the forward, H x W for the backward)."""
    check_window(k, a)
    check_pooled_tensors(a, a.B * a.C, "B*C")
    check_channel_alignment(k.c_align, a.C)
    pixels = a.B * (a.H * a.W if hasattr(a, "dx") else a.OH * a.OW)
    if a.B * a.H * a.W > INT32_MAX:
        raise ValueError(f"B: {a.B} images of {a.H}x{a.W} exceed the int32 pixel index")
    return check_grid_3d(cdiv(pixels, k.block_p), cdiv(a.C, k.block_c), 1)


@triton.jit
def pixel_tile(B, C, rows, cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr):
    """Program (i, j)'s tile of the B x rows x cols pixels a kernel writes: pixels q = i*BLOCK_P + [0, BLOCK_P)
    (q = (b*rows + r)*cols + s) by channels c = j*BLOCK_C + [0, BLOCK_C). Returns q, b, r, s, c, whether each
    pixel exists (q < B*rows*cols) and whether each channel does (`columns_in`)."""
    q, b, r, s = nhwc_pixels(tl.program_id(0), rows, cols, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return q, b, r, s, c, q < B * rows * cols, columns_in(c, C, C_ALIGN)


@triton.jit
def pixel_means(sums, h0, w0, H, W, KH: tl.constexpr, KW: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr, UNIFORM: tl.constexpr):
    """Sums [P, C] of the windows starting at (h0, w0) [P] over their divisors: DIVISOR_OVERRIDE or KH*KW (when
    UNIFORM) as a multiply by the reciprocal, as `gather.window_means` does, else the count
    `gather.window_divisor` takes (at least 1: windows that do not exist are masked off)."""
    if DIVISOR_OVERRIDE > 0:
        means = sums * (1.0 / DIVISOR_OVERRIDE)
    elif UNIFORM:
        means = sums * (1.0 / (KH * KW))
    else:
        if COUNT_INCLUDE_PAD:
            count = (tl.minimum(h0 + KH, H + PAD_H) - h0) * (tl.minimum(w0 + KW, W + PAD_W) - w0)
        else:
            count = (tl.minimum(h0 + KH, H) - tl.maximum(h0, 0)) * (tl.minimum(w0 + KW, W) - tl.maximum(w0, 0))
        means = sums / tl.maximum(count, 1).to(tl.float32)[:, None]
    return means


# What both kernels declare: their example constants, entry check, and the helpers their source takes.
_CL_POOL_KERNEL = dict(example=(3, 3, 2, 2, 1, 1, False, 0, False, 32, 64, 8), entry=avg_pool2d_cl_entry,
                       nonnegative=("PAD_H", "PAD_W", "DIVISOR_OVERRIDE"), flags=("COUNT_INCLUDE_PAD", "UNIFORM"),
                       helpers=(pixel_tile, nhwc_pixels, columns_in, nhwc_row, load_nhwc, store_nhwc, pixel_means))


@triton.jit
def avg_pool2d_cl_forward(
    x, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """2-D average pooling forward, channels-last.

    Grid: (cdiv(B*OH*OW, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for output pixels
    q = i*BLOCK_P + ... (q = (b*OH + oh)*OW + ow) and channels c = j*BLOCK_C + ...,
        y[q, c] = (1 / divisor(oh, ow)) * sum over in-image (ih, iw) of the window of x[b, ih, iw, c]
    with h0 = oh*STRIDE_H - PAD_H, w0 = ow*STRIDE_W - PAD_W the window's first row and column. Sums in fp32;
    every y is written.
    """
    q, b, oh, ow, c, q_ok, c_ok = pixel_tile(B, C, OH, OW, BLOCK_P, BLOCK_C, C_ALIGN)
    h0 = oh * STRIDE_H - PAD_H
    w0 = ow * STRIDE_W - PAD_W
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            acc += load_nhwc(x, b, h0 + kh, w0 + kw, c, H, W, C, q_ok, c_ok, C_ALIGN).to(tl.float32)
    means = pixel_means(acc, h0, w0, H, W, KH, KW, PAD_H, PAD_W, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE, UNIFORM)
    store_nhwc(y, q, c, C, means, q_ok, c_ok, C_ALIGN)


AvgPool2dClForward = kernel_object(avg_pool2d_cl_forward, **_CL_POOL_KERNEL)


@triton.jit
def avg_pool2d_cl_backward(
    dy, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """2-D average pooling backward, channels-last, gathered: no atomics, deterministic, no zero-init.

    Grid: (cdiv(B*H*W, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for input pixels
    q = i*BLOCK_P + ... (q = (b*H + ih)*W + iw) and channels c = j*BLOCK_C + ...,
        dx[q, c] = sum over windows (oh, ow) covering (ih, iw) of dy[b, oh, ow, c] / divisor(oh, ow).
    The covering oh are (ih + PAD_H) // STRIDE_H - j for j < cdiv(KH, STRIDE_H), kept when 0 <= oh < OH and
    ih + PAD_H - oh*STRIDE_H < KH (likewise ow). Sums in fp32; every dx is written.
    """
    q, b, ih, iw, c, q_ok, c_ok = pixel_tile(B, C, H, W, BLOCK_P, BLOCK_C, C_ALIGN)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range((KH + STRIDE_H - 1) // STRIDE_H):
        oh = (ih + PAD_H) // STRIDE_H - j
        for i in tl.static_range((KW + STRIDE_W - 1) // STRIDE_W):
            ow = (iw + PAD_W) // STRIDE_W - i
            covers = q_ok & (ih + PAD_H - oh * STRIDE_H < KH) & (iw + PAD_W - ow * STRIDE_W < KW)
            dyv = load_nhwc(dy, b, oh, ow, c, OH, OW, C, covers, c_ok, C_ALIGN)
            acc += pixel_means(dyv.to(tl.float32), oh * STRIDE_H - PAD_H, ow * STRIDE_W - PAD_W, H, W, KH, KW, PAD_H,
                               PAD_W, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE, UNIFORM)
    store_nhwc(dx, q, c, C, acc, q_ok, c_ok, C_ALIGN)


AvgPool2dClBackward = kernel_object(avg_pool2d_cl_backward, **_CL_POOL_KERNEL)
