"""2-D average pooling with all of `torch.nn.functional.avg_pool2d`'s options, forward and a
gather backward: `AvgPool2dGatherForward`, `AvgPool2dGatherBackward`.

Both kernels tile a plane-major matrix: a row is (plane, oh) for the forward and (plane, ih)
for the backward (plane = b*C + c, so one program spans several small planes), a column is
ow or iw. Window (oh, ow) covers rows h0 = oh*STRIDE_H - PAD_H ... h0 + KH - 1 (likewise w0).
Its divisor, as PyTorch defines it:
- DIVISOR_OVERRIDE when it is > 0;
- else with COUNT_INCLUDE_PAD: (min(h0 + KH, H + PAD_H) - h0) * (min(w0 + KW, W + PAD_W) - w0),
  the window clipped to the padded image (a ceil_mode window can overhang it);
- else the number of window elements inside the image.
UNIFORM (chosen by the launcher) says every window's divisor is KH*KW, which skips the
per-window count. ROW_ALIGN (a power of two <= 16 dividing the written rows' length, OW or W)
lets rows be stored with vector instructions. The backward gathers: each dx element sums dy/divisor over the
windows that cover it, so it needs no atomics, no zero-initialisation, and is deterministic.
"""
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_grid, check_numel
from ..common.host_math import cdiv
from ..common.tiles import columns_in
from .epilogue import store_rows


def pooled_size(size, kernel, stride, pad, ceil_mode):
    """PyTorch's output length: floor or ceil of (size + 2*pad - kernel) / stride, plus one, less
    one when ceil_mode would start the last window beyond the image and its left padding."""
    span = size + 2 * pad - kernel
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def uniform_divisor(k, H, W, OH, OW):
    """True when every window's divisor is KH*KW (count_include_pad and no window past the padding)."""
    if k.divisor_override or not k.count_include_pad:
        return False
    return (OH - 1) * k.stride_h + k.kh <= H + 2 * k.pad_h and (OW - 1) * k.stride_w + k.kw <= W + 2 * k.pad_w


def contiguous_row_align(k, W, OW):
    """The forward's X_ALIGN: 0 unless the windows tile each row exactly (kw == stride_w, a power
    of two > 1, no column padding, OW*kw <= W); then the largest power of two <= 16 dividing W
    and OW*kw (at least 1)."""
    if k.kw != k.stride_w or k.kw < 2 or k.kw & (k.kw - 1) or k.pad_w or OW * k.kw > W:
        return 0
    return min(row_align(W), row_align(OW * k.kw))


def check_window(k, a):
    """The checks every pooling launch shares: padding at most half the window, OH and OW pooled sizes of H and W
    (floor or ceil mode), the UNIFORM flag as the options and sizes make it."""
    for kernel, pad, name in ((k.kh, k.pad_h, "pad_h"), (k.kw, k.pad_w, "pad_w")):
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


def check_pooled_tensors(a, planes, planes_name):
    """x and dx (those the launch has) hold `planes` planes of H x W elements, y and dy of OH x OW."""
    for name, size, size_name in (("x", a.H * a.W, "H*W"), ("dx", a.H * a.W, "H*W"), ("y", a.OH * a.OW, "OH*OW"),
                                  ("dy", a.OH * a.OW, "OH*OW")):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), planes * size, f"{planes_name}*{size_name}")


def avg_pool2d_gather_entry(k, a):
    """Check a gather pooling launch (forward or backward) and return its flat grid over tiles."""
    check_window(k, a)
    written = a.W if hasattr(a, "dx") else a.OW
    if k.row_align > 16 or k.row_align & (k.row_align - 1) or written % k.row_align:
        raise ValueError(f"row_align: expected a power of two <= 16 dividing {written}, got {k.row_align}")
    x_align = getattr(k, "x_align", 0)
    if x_align and x_align != contiguous_row_align(k, a.W, a.OW):
        raise ValueError(f"x_align: expected {contiguous_row_align(k, a.W, a.OW)} for these sizes and options, "
                         f"got {x_align}")
    check_pooled_tensors(a, a.P, "P")
    rows = a.P * (a.H if hasattr(a, "dx") else a.OH)
    if rows > INT32_MAX or a.H * a.W > INT32_MAX:
        raise ValueError(f"P: {a.P} planes of {a.H}x{a.W} exceed the int32 row and plane indices")
    cols = a.W if hasattr(a, "dx") else a.OW
    return check_grid(cdiv(rows, k.block_r) * cdiv(cols, k.block_w))


@triton.jit
def window_divisor(h0, w0, H, W, KH: tl.constexpr, KW: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                   COUNT_INCLUDE_PAD: tl.constexpr):
    """fp32 divisors [R, C] of the windows starting at rows h0 [R] and columns w0 [C], as PyTorch
    counts them (module docstring), and at least 1: lanes past the tile's edge or windows that do
    not exist may count 0, and their values are never stored (or are 0), so 1 does no harm."""
    if COUNT_INCLUDE_PAD:
        rows_counted = tl.minimum(h0 + KH, H + PAD_H) - h0
        cols_counted = tl.minimum(w0 + KW, W + PAD_W) - w0
    else:
        rows_counted = tl.minimum(h0 + KH, H) - tl.maximum(h0, 0)
        cols_counted = tl.minimum(w0 + KW, W) - tl.maximum(w0, 0)
    return tl.maximum(rows_counted[:, None] * cols_counted[None, :], 1).to(tl.float32)


@triton.jit
def window_means(sums, h0, w0, H, W, KH: tl.constexpr, KW: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                 COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr, UNIFORM: tl.constexpr):
    """Window sums [R, C] (windows at rows h0 [R], columns w0 [C]) over their divisors: DIVISOR_OVERRIDE,
    KH*KW when UNIFORM, else `window_divisor`. A constant divisor is a multiply by its reciprocal
    (div.full.f32 costs several instructions per output); the result is within an ulp of the quotient."""
    if DIVISOR_OVERRIDE > 0:
        means = sums * (1.0 / DIVISOR_OVERRIDE)
    elif UNIFORM:
        means = sums * (1.0 / (KH * KW))
    else:
        means = sums / window_divisor(h0, w0, H, W, KH, KW, PAD_H, PAD_W, COUNT_INCLUDE_PAD)
    return means


@triton.jit
def covering_window(index, j, valid, size, K: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr):
    """Along one axis, window o = (index + PAD) // STRIDE - j, the j-th that may cover input position `index`, and
    `valid` & whether it does: 0 <= o < size and index + PAD - o*STRIDE < K (its K taps reach `index`)."""
    o = (index + PAD) // STRIDE - j
    return o, valid & (o >= 0) & (o < size) & (index + PAD - o * STRIDE < K)


@triton.jit
def _gather_tile(columns, rows_per_plane, P, ROW_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's BLOCK_R x BLOCK_W tile of rows r = plane*rows_per_plane + index over P planes (row tiles
    outer, tiles of BLOCK_W of the `columns` inner): (rows, column tile, columns, plane, index, whether the row
    exists, whether the column does, by `columns_in`)."""
    pid = tl.program_id(0)
    num_col_tiles = tl.cdiv(columns, BLOCK_W)
    rows = (pid // num_col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_tile = pid % num_col_tiles
    cols = col_tile * BLOCK_W + tl.arange(0, BLOCK_W)
    plane = rows // rows_per_plane
    return (rows, col_tile, cols, plane, rows - plane * rows_per_plane, rows < P * rows_per_plane,
            columns_in(cols, columns, ROW_ALIGN))


@triton.jit
def avg_pool2d_gather_forward(
    x, y, P, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, ROW_ALIGN: tl.constexpr, X_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """2-D average pooling forward with padding, ceil_mode windows and any divisor rule.

    Grid: pid = row_tile * cdiv(OW, BLOCK_W) + col_tile over rows r = plane*OH + oh (P*OH rows).
    One program writes y[plane, oh, ow] for its BLOCK_R x BLOCK_W tile:
        y = (1 / divisor(oh, ow)) * sum over in-image (ih, iw) of the window of x[plane, ih, iw]
    (padding contributes zeros; divisor as in the module docstring). Sums in fp32; every y is written.
    X_ALIGN > 0 selects the contiguous-row path, for windows that tile each row exactly
    (KW == STRIDE_W, a power of two; no column padding or overhang): per kh it loads the
    BLOCK_W*KW contiguous x of the tile's columns with vector loads and sums groups of KW;
    X_ALIGN is then a power of two dividing W and OW*KW. X_ALIGN = 0 gathers tap by tap.
    """
    rows, col_tile, ow, plane, oh, row_in, col_in = _gather_tile(OW, OH, P, ROW_ALIGN, BLOCK_R, BLOCK_W)
    h0 = oh * STRIDE_H - PAD_H
    w0 = ow * STRIDE_W - PAD_W
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
    if X_ALIGN > 0:
        c = col_tile * (BLOCK_W * KW) + tl.arange(0, BLOCK_W * KW)
        c_in = (c // X_ALIGN) < ((OW * KW) // X_ALIGN)
        for kh in tl.static_range(KH):
            ih = h0 + kh
            ih_in = row_in & (ih >= 0) & (ih < H)
            x_row = tl.multiple_of((plane.to(tl.int64) * H + ih) * W, X_ALIGN)
            xv = tl.load(x + x_row[:, None] + c[None, :], mask=ih_in[:, None] & c_in[None, :], other=0.0)
            acc += tl.sum(tl.reshape(xv.to(tl.float32), [BLOCK_R, BLOCK_W, KW]), axis=2)
    else:
        x_plane = x + plane.to(tl.int64) * H * W
        tile_in = row_in[:, None] & col_in[None, :]
        for kh in tl.static_range(KH):
            ih = h0 + kh
            x_row = x_plane + ih * W
            ih_in = row_in & (ih >= 0) & (ih < H)
            for kw in tl.static_range(KW):
                iw = w0 + kw
                # Unpadded uniform windows all lie inside the image: one mask serves every tap.
                if PAD_H == 0 and PAD_W == 0 and UNIFORM:
                    inside = tile_in
                else:
                    inside = ih_in[:, None] & (col_in & (iw >= 0) & (iw < W))[None, :]
                xv = tl.load(x_row[:, None] + iw[None, :], mask=inside, other=0.0)
                acc += xv.to(tl.float32)
    out = window_means(acc, h0, w0, H, W, KH, KW, PAD_H, PAD_W, COUNT_INCLUDE_PAD, DIVISOR_OVERRIDE, UNIFORM)
    store_rows(y, rows, ow, OW, out, row_in, ROW_ALIGN)


@triton.jit
def avg_pool2d_gather_backward(
    dy, dx, P, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """2-D average pooling backward by gathering: no atomics, deterministic, no zero-init.

    Grid: pid = row_tile * cdiv(W, BLOCK_W) + col_tile over rows r = plane*H + ih (P*H rows).
    One program writes dx[plane, ih, iw] for its BLOCK_R x BLOCK_W tile:
        dx = sum over windows (oh, ow) covering (ih, iw) of dy[plane, oh, ow] / divisor(oh, ow).
    The covering oh are (ih + PAD_H) // STRIDE_H - j for j < cdiv(KH, STRIDE_H), kept when
    0 <= oh < OH and ih + PAD_H - oh*STRIDE_H < KH (likewise ow). Every dx is written.
    """
    rows, _, iw, plane, ih, row_in, col_in = _gather_tile(W, H, P, ROW_ALIGN, BLOCK_R, BLOCK_W)
    dy_plane = dy + plane.to(tl.int64) * OH * OW
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
    for j in tl.static_range((KH + STRIDE_H - 1) // STRIDE_H):
        oh, oh_in = covering_window(ih, j, row_in, OH, KH, STRIDE_H, PAD_H)
        dy_row = dy_plane + oh * OW
        for i in tl.static_range((KW + STRIDE_W - 1) // STRIDE_W):
            ow, ow_in = covering_window(iw, i, col_in, OW, KW, STRIDE_W, PAD_W)
            dyv = tl.load(dy_row[:, None] + ow[None, :], mask=oh_in[:, None] & ow_in[None, :], other=0.0)
            if DIVISOR_OVERRIDE > 0 or UNIFORM:
                acc += dyv.to(tl.float32)
            else:
                divisor = window_divisor(oh * STRIDE_H - PAD_H, ow * STRIDE_W - PAD_W, H, W, KH, KW, PAD_H, PAD_W,
                                         COUNT_INCLUDE_PAD)
                acc += dyv.to(tl.float32) / divisor
    if DIVISOR_OVERRIDE > 0:
        acc = acc / DIVISOR_OVERRIDE
    elif UNIFORM:
        acc = acc / (KH * KW)
    store_rows(dx, rows, iw, W, acc, row_in, ROW_ALIGN)


_OPTIONS = dict(
    entry=avg_pool2d_gather_entry,
    nonnegative=("PAD_H", "PAD_W", "DIVISOR_OVERRIDE", "X_ALIGN"),
    flags=("COUNT_INCLUDE_PAD", "UNIFORM"),
    helpers=(_gather_tile, columns_in, covering_window, window_divisor, window_means, store_rows),
)
AvgPool2dGatherForward = kernel_object(
    avg_pool2d_gather_forward, example=(3, 3, 1, 1, 1, 1, True, 0, True, 8, 0, 32, 64), **_OPTIONS)
AvgPool2dGatherBackward = kernel_object(
    avg_pool2d_gather_backward, example=(3, 3, 1, 1, 1, 1, True, 0, True, 8, 32, 64), **_OPTIONS)


def row_align(length):
    """The largest power of two <= 16 that divides `length`."""
    return min(16, length & -length)
