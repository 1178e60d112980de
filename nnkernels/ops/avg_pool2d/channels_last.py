"""2-D average pooling on channels-last tensors, forward and a gather backward: `AvgPool2dClForward`,
`AvgPool2dClBackward`, with all of `torch.nn.functional.avg_pool2d`'s options (divisors as `gather.py`'s module
docstring defines them).

x, y, dy and dx are NHWC arrays ([B, H, W, C], a channels-last tensor's storage). A program takes BLOCK_P pixels
(b, row, column, numbered in that order) by BLOCK_C channels, so every load and store is a run of consecutive
channels of one pixel: no layout copy either way. The backward gathers (no atomics, deterministic, every dx
written)."""
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_grid_3d, check_numel
from ..common.host_math import cdiv
from ..common.tiles import nhwc_pixels
from .gather import pooled_size, uniform_divisor


def avg_pool2d_cl_entry(k, a):
    """Check a channels-last pooling launch and return its grid (cdiv(B*rows*cols, BLOCK_P), cdiv(C, BLOCK_C)) over
    the pixels it writes (OH x OW for the forward, H x W for the backward)."""
    for pad, kernel, name in ((k.pad_h, k.kh, "pad_h"), (k.pad_w, k.kw, "pad_w")):
        if 2 * pad > kernel:
            raise ValueError(f"{name}: expected at most half the window ({kernel}), got {pad}")
    for got, size, kernel, stride, pad, name in ((a.OH, a.H, k.kh, k.stride_h, k.pad_h, "OH"),
                                                 (a.OW, a.W, k.kw, k.stride_w, k.pad_w, "OW")):
        valid = {pooled_size(size, kernel, stride, pad, ceil) for ceil in (False, True)}
        if got not in valid or size + 2 * pad < kernel:
            raise ValueError(f"{name}: expected the pooled size {sorted(valid)} of the input, got {got}")
    uniform = uniform_divisor(k, a.H, a.W, a.OH, a.OW)
    if k.uniform != uniform:
        raise ValueError(f"uniform: expected {uniform} for these sizes and options, got {k.uniform}")
    for name in ("x", "dx"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.H * a.W * a.C, "B*H*W*C")
    for name in ("y", "dy"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.OH * a.OW * a.C, "B*OH*OW*C")
    pixels = a.B * (a.H * a.W if hasattr(a, "dx") else a.OH * a.OW)
    if a.B * a.H * a.W > INT32_MAX:
        raise ValueError(f"B: {a.B} images of {a.H}x{a.W} exceed the int32 pixel index")
    return check_grid_3d(cdiv(pixels, k.block_p), cdiv(a.C, k.block_c), 1)


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


@triton.jit
def avg_pool2d_cl_forward(
    x, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """2-D average pooling forward, channels-last.

    Grid: (cdiv(B*OH*OW, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for output pixels
    q = i*BLOCK_P + ... (q = (b*OH + oh)*OW + ow) and channels c = j*BLOCK_C + ...,
        y[q, c] = (1 / divisor(oh, ow)) * sum over in-image (ih, iw) of the window of x[b, ih, iw, c]
    with h0 = oh*STRIDE_H - PAD_H, w0 = ow*STRIDE_W - PAD_W the window's first row and column. Sums in fp32;
    every y is written.
    """
    q, b, oh, ow = nhwc_pixels(tl.program_id(0), OH, OW, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    q_ok = q < B * OH * OW
    c_ok = c < C
    h0 = oh * STRIDE_H - PAD_H
    w0 = ow * STRIDE_W - PAD_W
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = h0 + kh
        row_ok = q_ok & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = w0 + kw
            inside = row_ok & (iw >= 0) & (iw < W)
            pixel = ((b * H + ih) * W + iw).to(tl.int64) * C
            xv = tl.load(x + pixel[:, None] + c[None, :], mask=inside[:, None] & c_ok[None, :], other=0.0)
            acc += xv.to(tl.float32)
    means = pixel_means(acc, h0, w0, H, W, KH, KW, PAD_H, PAD_W, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE, UNIFORM)
    out = q.to(tl.int64) * C
    tl.store(y + out[:, None] + c[None, :], means.to(y.dtype.element_ty), mask=q_ok[:, None] & c_ok[None, :])


AvgPool2dClForward = kernel_object(
    avg_pool2d_cl_forward,
    example=(3, 3, 2, 2, 1, 1, False, 0, False, 32, 64),
    entry=avg_pool2d_cl_entry,
    nonnegative=("PAD_H", "PAD_W", "DIVISOR_OVERRIDE"),
    flags=("COUNT_INCLUDE_PAD", "UNIFORM"),
    helpers=(nhwc_pixels, pixel_means),
)


@triton.jit
def avg_pool2d_cl_backward(
    dy, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """2-D average pooling backward, channels-last, gathered: no atomics, deterministic, no zero-init.

    Grid: (cdiv(B*H*W, BLOCK_P), cdiv(C, BLOCK_C)). Program (i, j) writes, for input pixels
    q = i*BLOCK_P + ... (q = (b*H + ih)*W + iw) and channels c = j*BLOCK_C + ...,
        dx[q, c] = sum over windows (oh, ow) covering (ih, iw) of dy[b, oh, ow, c] / divisor(oh, ow).
    The covering oh are (ih + PAD_H) // STRIDE_H - j for j < cdiv(KH, STRIDE_H), kept when 0 <= oh < OH and
    ih + PAD_H - oh*STRIDE_H < KH (likewise ow). Sums in fp32; every dx is written.
    """
    q, b, ih, iw = nhwc_pixels(tl.program_id(0), H, W, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    q_ok = q < B * H * W
    c_ok = c < C
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range((KH + STRIDE_H - 1) // STRIDE_H):
        oh = (ih + PAD_H) // STRIDE_H - j
        row_ok = q_ok & (oh >= 0) & (oh < OH) & (ih + PAD_H - oh * STRIDE_H < KH)
        for i in tl.static_range((KW + STRIDE_W - 1) // STRIDE_W):
            ow = (iw + PAD_W) // STRIDE_W - i
            inside = row_ok & (ow >= 0) & (ow < OW) & (iw + PAD_W - ow * STRIDE_W < KW)
            pixel = ((b * OH + oh) * OW + ow).to(tl.int64) * C
            dyv = tl.load(dy + pixel[:, None] + c[None, :], mask=inside[:, None] & c_ok[None, :], other=0.0)
            acc += pixel_means(dyv.to(tl.float32), oh * STRIDE_H - PAD_H, ow * STRIDE_W - PAD_W, H, W, KH, KW, PAD_H,
                               PAD_W, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE, UNIFORM)
    out = q.to(tl.int64) * C
    tl.store(dx + out[:, None] + c[None, :], acc.to(dx.dtype.element_ty), mask=q_ok[:, None] & c_ok[None, :])


AvgPool2dClBackward = kernel_object(
    avg_pool2d_cl_backward,
    example=(3, 3, 2, 2, 1, 1, False, 0, False, 32, 64),
    entry=avg_pool2d_cl_entry,
    nonnegative=("PAD_H", "PAD_W", "DIVISOR_OVERRIDE"),
    flags=("COUNT_INCLUDE_PAD", "UNIFORM"),
    helpers=(nhwc_pixels, pixel_means),
)
