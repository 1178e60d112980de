"""Depthwise 2-D convolution (groups == C_IN == C_OUT), direct: forward, dx and dw kernels.

With one input channel per output channel the GEMM has K = KH*KW and N = 1, so tensor cores
would idle; the work is memory-bound and a direct stencil over each plane is the right shape.
What bounds such a stencil on the GPU is instructions per pixel, not bytes: each program takes a
band of rows of a few planes, unrolled, and loads each input row once per kw for every output row
that reads it (3x3, 14-row bands: 3.4 loads per output pixel, not 9); masks and addresses come
from a column vector and a row scalar, never a division per pixel.
dx is gathered (no atomics); dw is split over its work items into fp32 partial rows that
`Conv2dDwReduce` adds in a fixed order, so both are bitwise reproducible."""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid_3d, check_numel
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tiles import zero_tiles


def _depthwise_sizes(a):
    """The launch's sizes under the names `check_conv_launch` expects (C_IN = C_OUT = C)."""
    names = dict(vars(a))
    names.update(C_IN=a.C, C_OUT=a.C)
    return type(a)(**names)


def gather_columns_fit(stride_w, kw, dil_w, columns, block_w):
    """Whether a row of `columns` written columns can be loaded once and its taps gathered across lanes
    (`_row_taps`): unit stride, the row plus its KW-1 shifts within one BLOCK_W tile, and that tile
    within a warp's 32 lanes, where the gather is a shuffle (wider, Triton stages it through shared
    memory with barriers: measured 2x slower on the H200, MobileNetV2 144@56)."""
    return stride_w == 1 and columns + (kw - 1) * dil_w <= block_w <= 32


def check_gather_columns(k, columns):
    """A launch with GATHER_COLUMNS must fit it (`gather_columns_fit`) for its `columns` written columns."""
    if k.gather_columns and not gather_columns_fit(k.stride_w, k.kw, k.dil_w, columns, k.block_w):
        raise ValueError(f"gather_columns: needs stride_w = 1 and {columns} columns + (kw-1)*dil_w <= "
                         f"block_w = {k.block_w}, got stride_w = {k.stride_w}")


def conv2d_depthwise_forward_entry(k, a):
    """Grid (cdiv(B*C, PLANES), cdiv(OH, ROWS), cdiv(OW, BLOCK_W)) for `Conv2dDepthwiseForward`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    if k.has_bias:
        check_numel("bias", a.bias, a.C, "C")
    check_gather_columns(k, a.OW)
    return check_grid_3d(cdiv(a.B * a.C, k.planes), cdiv(a.OH, k.rows), cdiv(a.OW, k.block_w))


def conv2d_depthwise_dx_entry(k, a):
    """Grid (cdiv(B*C, PLANES), cdiv(H, ROWS), cdiv(W, BLOCK_W)) for `Conv2dDepthwiseDx`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    if k.rows % k.stride_h:
        raise ValueError(f"rows: expected a multiple of stride_h = {k.stride_h}, got {k.rows}")
    return check_grid_3d(cdiv(a.B * a.C, k.planes), cdiv(a.H, k.rows), cdiv(a.W, k.block_w))


def conv2d_depthwise_dw_entry(k, a):
    """Grid (cdiv(C, PLANES), SPLIT) for `Conv2dDepthwiseDw`."""
    check_conv_launch(k, _depthwise_sizes(a), a.C)
    if k.block_taps <= k.kh * k.kw:
        raise ValueError(f"block_taps: expected more than kh*kw = {k.kh * k.kw} (a column for the bias), "
                         f"got {k.block_taps}")
    items = a.B * cdiv(a.OH, k.rows) * cdiv(a.OW, k.block_w)
    if a.SPLIT > items:
        raise ValueError(f"SPLIT: expected at most the {items} work items B*cdiv(OH, ROWS)*cdiv(OW, BLOCK_W), "
                         f"got {a.SPLIT}")
    check_gather_columns(k, a.OW)
    if not k.ragged_bands and a.OH % k.rows:
        raise ValueError(f"RAGGED_BANDS: expected True where OH = {a.OH} is not a multiple of ROWS = {k.rows}, "
                         "got False")
    row = dw_partial_size(a.C, 1, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C*KH*KW [+ C with HAS_BIAS])")
    return check_grid_3d(cdiv(a.C, k.planes), a.SPLIT, 1)


@triton.jit
def _where_row(mask, row_ok):
    """`mask & row_ok` for one row's scalar `row_ok` (Triton's interpreter cannot AND a scalar into a
    tensor mask; compiled, the select is that AND)."""
    return tl.where(row_ok, mask, False)


@triton.jit
def _row_taps(row_0, row_ok, iw_first, W, KW: tl.constexpr, DIL_W: tl.constexpr, GATHER_COLUMNS: tl.constexpr,
              BLOCK_W: tl.constexpr):
    """The KW shifts of one input row, as fp32 [PLANES, BLOCK_W] tensors: tap kw holds
    row[iw_first + kw*DIL_W] (`row_0` points at iw_first), 0 outside 0 <= iw < W or where not `row_ok`.
    GATHER_COLUMNS (iw_first consecutive across the lanes, and at least (KW-1)*DIL_W lanes past the
    written columns): the row is loaded once and its shifts gathered across lanes, a shuffle instead
    of a load per shift; a shift past the last lane repeats the last lane, in columns nobody writes."""
    taps = ()
    if GATHER_COLUMNS:
        row = tl.load(row_0, mask=row_ok & ((iw_first >= 0) & (iw_first < W))[None, :], other=0.0).to(tl.float32)
        lane = tl.arange(0, BLOCK_W)
        taps = taps + (row,)
        for kw in tl.static_range(1, KW):
            column = tl.minimum(lane + kw * DIL_W, BLOCK_W - 1)
            taps = taps + (tl.gather(row, tl.broadcast_to(column[None, :], row.shape), axis=1),)
    else:
        for kw in tl.static_range(KW):
            iw = iw_first + kw * DIL_W
            inside = row_ok & ((iw >= 0) & (iw < W))[None, :]
            taps = taps + (tl.load(row_0 + kw * DIL_W, mask=inside, other=0.0).to(tl.float32),)
    return taps


@triton.jit
def _plane_weights(w, c, plane_ok, TAPS: tl.constexpr):
    """The TAPS weights w[c, 0, tap] of each plane's channel, as fp32 [PLANES, 1] columns."""
    taps = ()
    for tap in tl.static_range(TAPS):
        taps = taps + (tl.load(w + c * TAPS + tap, mask=plane_ok, other=0.0).to(tl.float32)[:, None],)
    return taps


@triton.jit
def conv2d_depthwise_forward(
    x, w, bias, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, PLANES: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
    GATHER_COLUMNS: tl.constexpr,
):
    """Depthwise 2-D convolution forward, direct, a band of rows per program.

    Grid: (cdiv(B*C, PLANES), cdiv(OH, ROWS), cdiv(OW, BLOCK_W)). Program (p, i, j) writes output rows
    oh = i*ROWS, ..., i*ROWS + ROWS-1 (those < OH), columns j*BLOCK_W, ... (those < OW), of the PLANES
    planes b*C + c = p*PLANES, ...:
        y[b, c, oh, ow] = bias[c] + sum over (kh, kw) of w[c, 0, kh, kw]
                          * x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W],
    x read as 0 outside the image, fp32 accumulation, y rounded once; bias read only when HAS_BIAS.
    Each input row the band reads is loaded once per kw and feeds every (output row, kh) that reads
    it: (ROWS-1)*STRIDE_H + (KH-1)*DIL_H + 1 rows instead of ROWS*KH. With GATHER_COLUMNS (STRIDE_W = 1,
    OW + (KW-1)*DIL_W <= BLOCK_W <= 32) a row is loaded once and its kw shifts gathered across lanes.
    """
    plane = tl.program_id(0) * PLANES + tl.arange(0, PLANES)
    plane_ok = plane < B * C
    c = plane % C
    oh_first = tl.program_id(1) * ROWS
    ow = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    iw_first = ow * STRIDE_W - PAD_W
    ih_first = oh_first * STRIDE_H - PAD_H
    x_row_0 = x + plane.to(tl.int64)[:, None] * H * W + iw_first[None, :]
    taps = _plane_weights(w, c, plane_ok, KH * KW)
    acc = zero_tiles(ROWS, PLANES, BLOCK_W)
    for t in tl.static_range((ROWS - 1) * STRIDE_H + (KH - 1) * DIL_H + 1):
        ih = ih_first + t
        row_ok = _where_row(plane_ok[:, None], (ih >= 0) & (ih < H))
        x_values = _row_taps(x_row_0 + ih * W, row_ok, iw_first, W, KW, DIL_W, GATHER_COLUMNS, BLOCK_W)
        for kw in tl.static_range(KW):
            # The band rows that row t feeds, r*STRIDE_H + kh*DIL_H == t, in ascending order (a one-step range
            # names r as a constant): KH tests per row and shift rather than ROWS*KH keep the build short.
            for kh in tl.static_range(KH - 1, -1, -1):
                for r in tl.static_range((t - kh * DIL_H) // STRIDE_H, (t - kh * DIL_H) // STRIDE_H + 1):
                    if r >= 0 and r < ROWS:
                        if r * STRIDE_H + kh * DIL_H == t:
                            acc = acc[:r] + (acc[r] + x_values[kw] * taps[kh * KW + kw],) + acc[r + 1:]
    if HAS_BIAS:
        bias_values = tl.load(bias + c, mask=plane_ok, other=0.0).to(tl.float32)[:, None]
    y_row_0 = y + plane.to(tl.int64)[:, None] * OH * OW + ow[None, :]
    column_ok = plane_ok[:, None] & (ow < OW)[None, :]
    for r in tl.static_range(ROWS):
        out = acc[r]
        if HAS_BIAS:
            out += bias_values
        oh = oh_first + r
        tl.store(y_row_0 + oh * OW, out.to(y.dtype.element_ty), mask=_where_row(column_ok, oh < OH))


@triton.jit
def conv2d_depthwise_dx(
    dy, w, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    PLANES: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Depthwise 2-D convolution data gradient, direct gather (no atomics), a band of rows per program.

    Grid: (cdiv(B*C, PLANES), cdiv(H, ROWS), cdiv(W, BLOCK_W)); ROWS a multiple of STRIDE_H. Program
    (p, i, j) writes dx rows ih = i*ROWS, ..., i*ROWS + ROWS-1 (those < H), columns j*BLOCK_W, ...
    (those < W), of the PLANES planes b*C + c = p*PLANES, ...:
        dx[b, c, ih, iw] = sum over (kh, kw) of dy[b, c, oh, ow] * w[c, 0, kh, kw],
        oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H, ow = (iw + PAD_W - kw*DIL_W) / STRIDE_W,
    over the taps where both divisions are exact and (oh, ow) lies in dy. fp32 accumulation, dx
    rounded once; every element of dx is written. A band starts on a multiple of STRIDE_H, so which
    taps meet a dy row is known at compile time, and each dy row is loaded once per kw.
    """
    plane = tl.program_id(0) * PLANES + tl.arange(0, PLANES)
    plane_ok = plane < B * C
    c = plane % C
    ih_first = tl.program_id(1) * ROWS
    oh_first = ih_first // STRIDE_H
    iw = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    dy_plane = dy + plane.to(tl.int64)[:, None] * OH * OW
    taps = _plane_weights(w, c, plane_ok, KH * KW)
    acc = zero_tiles(ROWS, PLANES, BLOCK_W)
    # dy row oh_first + t feeds dx row r through tap kh when r + PAD_H - kh*DIL_H == t*STRIDE_H.
    for t in tl.static_range((PAD_H - (KH - 1) * DIL_H) // STRIDE_H, (ROWS - 1 + PAD_H) // STRIDE_H + 1):
        oh = oh_first + t
        row_ok = _where_row(plane_ok[:, None], (oh >= 0) & (oh < OH))
        for kw in tl.static_range(KW):
            reach_w = iw + PAD_W - kw * DIL_W
            ow = reach_w // STRIDE_W
            hit = row_ok & ((reach_w >= 0) & (reach_w % STRIDE_W == 0) & (ow < OW))[None, :]
            dy_values = tl.load(dy_plane + oh * OW + ow[None, :], mask=hit, other=0.0).to(tl.float32)
            # The dx rows that dy row t feeds, r + PAD_H - kh*DIL_H == t*STRIDE_H, in ascending order (a one-step
            # range names r as a constant): KH tests per row and shift rather than ROWS*KH keep the build short.
            for kh in tl.static_range(KH):
                for r in tl.static_range(t * STRIDE_H + kh * DIL_H - PAD_H, t * STRIDE_H + kh * DIL_H - PAD_H + 1):
                    if r >= 0 and r < ROWS:
                        # Only taps that reach dy contribute: a NaN or Inf weight must not reach dx
                        # through padding.
                        updated = tl.where(hit, acc[r] + dy_values * taps[kh * KW + kw], acc[r])
                        acc = acc[:r] + (updated,) + acc[r + 1:]
    dx_row_0 = dx + plane.to(tl.int64)[:, None] * H * W + iw[None, :]
    column_ok = plane_ok[:, None] & (iw < W)[None, :]
    for r in tl.static_range(ROWS):
        ih = ih_first + r
        tl.store(dx_row_0 + ih * W, acc[r].to(dx.dtype.element_ty), mask=_where_row(column_ok, ih < H))


@triton.jit
def _depthwise_dw_band(
    dy_row_0, x_row_0, oh_first, ow, c_ok, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_TAPS: tl.constexpr, PLANES: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr, GATHER_COLUMNS: tl.constexpr, RAGGED: tl.constexpr,
):
    """The [PLANES, BLOCK_TAPS] sums of one band of `conv2d_depthwise_dw` (column BLOCK_TAPS - 1: the
    bias's, when HAS_BIAS). RAGGED: rows past OH are in the band and must add nothing (their dy reads
    as 0, but x there may be NaN or Inf); so must columns past OW."""
    tap = tl.arange(0, BLOCK_TAPS)
    ih_first = oh_first * STRIDE_H - PAD_H
    iw_first = ow * STRIDE_W - PAD_W
    column_ok = c_ok[:, None] & (ow < OW)[None, :]
    dy_rows = ()
    for r in tl.static_range(ROWS):
        oh = oh_first + r
        dy_row = tl.load(dy_row_0 + oh * OW, mask=_where_row(column_ok, oh < OH), other=0.0)
        dy_rows = dy_rows + (dy_row.to(tl.float32),)
    products = ()
    for k in tl.static_range(KH * KW):
        products = products + (tl.zeros_like(dy_rows[0]),)
    for t in tl.static_range((ROWS - 1) * STRIDE_H + (KH - 1) * DIL_H + 1):
        ih = ih_first + t
        if GATHER_COLUMNS:
            # The loaded row's lanes are x columns, not output columns: masked past OW after the shifts.
            shifts = _row_taps(x_row_0 + ih * W, _where_row(c_ok[:, None], (ih >= 0) & (ih < H)), iw_first, W, KW,
                               DIL_W, True, BLOCK_W)
        else:
            shifts = _row_taps(x_row_0 + ih * W, _where_row(column_ok, (ih >= 0) & (ih < H)), iw_first, W, KW,
                               DIL_W, False, BLOCK_W)
        for kw in tl.static_range(KW):
            x_values = shifts[kw]
            if GATHER_COLUMNS:
                x_values = tl.where(column_ok, x_values, 0.0)
            # The band rows that row t feeds, in ascending order (as in `conv2d_depthwise_forward`).
            for kh in tl.static_range(KH - 1, -1, -1):
                for r in tl.static_range((t - kh * DIL_H) // STRIDE_H, (t - kh * DIL_H) // STRIDE_H + 1):
                    if r >= 0 and r < ROWS:
                        if r * STRIDE_H + kh * DIL_H == t:
                            term = x_values * dy_rows[r]
                            if RAGGED:
                                term = tl.where(oh_first + r < OH, term, 0.0)
                            products = (products[:kh * KW + kw] + (products[kh * KW + kw] + term,)
                                        + products[kh * KW + kw + 1:])
    sums = tl.zeros([PLANES, BLOCK_TAPS], dtype=tl.float32)
    for k in tl.static_range(KH * KW):
        sums += tl.where(tap[None, :] == k, tl.sum(products[k], axis=1)[:, None], 0.0)
    if HAS_BIAS:
        dy_sum = dy_rows[0]
        for r in tl.static_range(1, ROWS):
            dy_sum += dy_rows[r]
        sums += tl.where(tap[None, :] == BLOCK_TAPS - 1, tl.sum(dy_sum, axis=1)[:, None], 0.0)
    return sums


@triton.jit
def conv2d_depthwise_dw(
    dy, x, partial, B, C, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_TAPS: tl.constexpr, PLANES: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr, GATHER_COLUMNS: tl.constexpr, RAGGED_BANDS: tl.constexpr,
):
    """Depthwise 2-D convolution weight gradient, split over the work (no atomics).

    Grid: (cdiv(C, PLANES), SPLIT). The work is cut into items (b, band, column tile): ROWS output
    rows and BLOCK_W output columns of one image, items numbered in that order. Program (p, s)
    takes the channels c = p*PLANES, ... and the items s, s + SPLIT, s + 2*SPLIT, ... (in that order)
    and writes
        partial[s, c*KH*KW + kh*KW + kw] = sum over its items' pixels of dy[b, c, oh, ow]
            * x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W]
    (x read as 0 outside the image) and, when HAS_BIAS, partial[s, C*KH*KW + c] = sum of dy[b, c, oh, ow].
    Sums in fp32, each item's reduced into a [PLANES, BLOCK_TAPS] accumulator (BLOCK_TAPS > KH*KW).
    GATHER_COLUMNS (STRIDE_W = 1, OW + (KW-1)*DIL_W <= BLOCK_W <= 32): x rows loaded once (`_row_taps`).
    RAGGED_BANDS: the last band of a plane may pass OH; False (OH % ROWS == 0) compiles the whole-band case alone.
    """
    c = tl.program_id(0) * PLANES + tl.arange(0, PLANES)
    c_ok = c < C
    split = tl.program_id(1)
    taps: tl.constexpr = KH * KW
    tap = tl.arange(0, BLOCK_TAPS)
    bands = tl.cdiv(OH, ROWS)
    column_tiles = tl.cdiv(OW, BLOCK_W)
    acc = tl.zeros([PLANES, BLOCK_TAPS], dtype=tl.float32)
    for item in range(split, B * bands * column_tiles, SPLIT):
        b = item // (bands * column_tiles)
        oh_first = (item // column_tiles) % bands * ROWS
        ow = (item % column_tiles) * BLOCK_W + tl.arange(0, BLOCK_W)
        plane = (b * C + c).to(tl.int64)[:, None]
        dy_row_0 = dy + plane * OH * OW + ow[None, :]
        x_row_0 = x + plane * H * W + (ow * STRIDE_W - PAD_W)[None, :]
        # The band's code is unrolled over rows and taps: a second, ragged copy of it doubles the build.
        whole_band = True
        if RAGGED_BANDS:
            whole_band = oh_first + ROWS <= OH
        if whole_band:
            acc += _depthwise_dw_band(dy_row_0, x_row_0, oh_first, ow, c_ok, H, W, OH, OW, KH, KW, STRIDE_H,
                                      STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, HAS_BIAS, BLOCK_TAPS, PLANES, ROWS, BLOCK_W,
                                      GATHER_COLUMNS, False)
        else:
            acc += _depthwise_dw_band(dy_row_0, x_row_0, oh_first, ow, c_ok, H, W, OH, OW, KH, KW, STRIDE_H,
                                      STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, HAS_BIAS, BLOCK_TAPS, PLANES, ROWS, BLOCK_W,
                                      GATHER_COLUMNS, True)
    row = partial_row(partial, split, C * taps, C, HAS_BIAS)
    tl.store(row + c[:, None] * taps + tap[None, :], acc, mask=c_ok[:, None] & (tap < taps)[None, :])
    if HAS_BIAS:
        tl.store(row + C * taps + c, tl.sum(tl.where(tap[None, :] == BLOCK_TAPS - 1, acc, 0.0), axis=1), mask=c_ok)


_GEOMETRY = (3, 3, 1, 1, 1, 1, 1, 1)
Conv2dDepthwiseForward = kernel_object(
    conv2d_depthwise_forward,
    helpers=(_where_row, _row_taps, _plane_weights, zero_tiles),
    example=_GEOMETRY + (False, 4, 7, 32, True),
    entry=conv2d_depthwise_forward_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "GATHER_COLUMNS"),
    num_stages=2,
)
Conv2dDepthwiseDx = kernel_object(
    conv2d_depthwise_dx,
    helpers=(_where_row, _plane_weights, zero_tiles),
    example=_GEOMETRY + (4, 7, 32),
    entry=conv2d_depthwise_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    num_stages=2,
)
Conv2dDepthwiseDw = kernel_object(
    conv2d_depthwise_dw,
    helpers=(_depthwise_dw_band, _where_row, _row_taps, *PARTIAL_ROW_HELPERS),
    example=_GEOMETRY + (False, 16, 4, 7, 32, True, True),
    entry=conv2d_depthwise_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "GATHER_COLUMNS", "RAGGED_BANDS"),
    num_stages=2,
)
