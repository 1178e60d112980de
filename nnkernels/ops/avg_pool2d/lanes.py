"""2-D average pooling from whole-vector row loads: `AvgPool2dLanesForward`, `AvgPool2dLanesBackward`.

The gather kernels (avg_pool2d_gather) load every tap of every window with its own scalar load,
about KH*KW load instructions per output. These kernels read each source row segment with aligned
vector loads instead and reuse it for every window it touches:

- a column *group* is LANES consecutive elements of a written row (y for the forward, dx for the
  backward; LANES a power of two <= 8 that is a multiple of STRIDE_W); group g of the written
  row is computed from group g of the source row (x, or dy), whose width is SRC = LANES*STRIDE_W
  (forward) or LANES // STRIDE_W (backward);
- a program owns BLOCK_R written rows (plane*OH + oh, or plane*H + ih) x BLOCK_G groups. It sums
  the source rows each written row needs (vertical first: whole-row vector loads, masked by row),
  splits the sum into its per-group lanes in registers (`tl.reshape` + `tl.split`, free when a
  group is held by one thread: one vector load), adds the lanes each output needs, horizontally,
  and joins the output lanes back into rows stored with vector stores;
- a window that reaches past its group takes the missing lanes from the neighbouring group
  (g-1 or g+1), loaded the same way: the launcher keeps every window within one group's reach.

Source rows are vector-loaded when their length is a multiple of SRC (SRC_VEC); otherwise (dy rows
of odd length) each source lane is its own scalar load, still one load per source element per row.
The forward takes every option of `avg_pool2d_gather`'s forward; the backward only divisors that
are the same for every window (UNIFORM or DIVISOR_OVERRIDE), as it sums dy before dividing.
`forward_lane_widths` / `backward_lane_widths` list every LANES a shape allows; `forward_lanes` /
`backward_lanes` give the first guess (a 16-byte group), and the launcher tunes among the rest.
"""
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.tiles import columns_in
from .epilogue import store_rows
from .gather import check_pooled_tensors, check_window, covering_window, row_align, window_divisor, window_means
from ..common.checks import check_grid
from ..common.host_math import cdiv


# The widest group `_split_lanes` / `_join_lanes` handle, in lanes and in source elements.
MOST_LANES = 8


def forward_lane_widths(k, W):
    """Every LANES the forward kernel takes for rows of W elements, widest first: source groups of
    SRC = LANES*stride_w elements (a power of two, 2 <= SRC <= MOST_LANES) dividing W, so each group
    is aligned vector loads, with every window within one group of its own (padding and overhang
    at most a group)."""
    widths = []
    for lanes in (8, 4, 2, 1):
        src = lanes * k.stride_w
        if 2 <= src <= MOST_LANES and not src & (src - 1) and W % src == 0:
            if k.pad_w <= src and k.kw - k.stride_w - k.pad_w <= src:
                widths.append(lanes)
    return widths


def forward_lanes(k, W, itemsize):
    """The forward's first-guess LANES, or 0 when the lanes kernel does not apply: the widest group
    whose source group is one vector of at most 16 bytes (`forward_lane_widths` may hold wider
    groups of two vectors, and narrower ones, for tuning to try)."""
    for lanes in (8, 4, 2, 1):
        src = lanes * k.stride_w
        if src * itemsize <= 16 and src >= 2 and not src & (src - 1) and W % src == 0:
            return lanes if lanes in forward_lane_widths(k, W) else 0
    return 0


def _backward_reach_ok(k, lanes):
    """The dy lanes a dx group of `lanes` takes lie within its own and the neighbouring groups."""
    src = lanes // k.stride_w
    first = -((k.kw - 1 - k.pad_w) // k.stride_w)  # the leftmost dy lane lane 0 takes
    last = (lanes - 1 + k.pad_w) // k.stride_w  # the rightmost dy lane lane LANES-1 takes
    return src >= 1 and first >= -src and last < 2 * src


def backward_lane_widths(k, W, uniform):
    """Every LANES the backward kernel takes, widest first: a power of two 2..MOST_LANES dividing
    W (so dx rows store whole groups), a multiple of stride_w, windows within a group's reach; only
    for one divisor for every window (UNIFORM or divisor_override)."""
    if not (uniform or k.divisor_override):
        return []
    return [lanes for lanes in (8, 4, 2) if lanes <= row_align(W) and lanes % k.stride_w == 0
            and _backward_reach_ok(k, lanes)]


def backward_src_vec(k, OW, lanes):
    """SRC_VEC of a backward group of `lanes`: dy rows vector-load when SRC = lanes // stride_w >= 2 divides OW."""
    src = lanes // k.stride_w
    return OW % src == 0 and src >= 2


def backward_lanes(k, W, OW, itemsize, uniform):
    """(LANES, SRC_VEC) of the backward's first guess, or (0, False) when it does not apply (a
    divisor that varies per window, or windows reaching past the neighbouring groups): the widest
    dx group of at most 16 bytes."""
    if not (uniform or k.divisor_override):
        return 0, False
    lanes = min(row_align(W), 16 // itemsize, MOST_LANES)
    if lanes < 2 or lanes % k.stride_w or not _backward_reach_ok(k, lanes):
        return 0, False
    return lanes, backward_src_vec(k, OW, lanes)


def avg_pool2d_lanes_entry(k, a):
    """Check a lanes pooling launch (forward or backward) and return its flat grid over tiles."""
    backward = hasattr(a, "dx")
    check_window(k, a)
    uniform = k.uniform
    if backward:
        widths = backward_lane_widths(k, a.W, uniform)
        if k.lanes not in widths or k.src_vec != backward_src_vec(k, a.OW, k.lanes):
            expected = [(lanes, backward_src_vec(k, a.OW, lanes)) for lanes in widths]
            raise ValueError(f"lanes, src_vec: expected one of {expected} for these sizes and options, "
                             f"got {(k.lanes, k.src_vec)}")
    elif k.lanes not in forward_lane_widths(k, a.W):
        raise ValueError(f"lanes: expected one of {forward_lane_widths(k, a.W)} for these sizes and options, "
                         f"got {k.lanes}")
    written = a.W if backward else a.OW
    if k.row_align != min(row_align(written), k.lanes):
        raise ValueError(f"row_align: expected {min(row_align(written), k.lanes)}, got {k.row_align}")
    check_pooled_tensors(a, a.P, "P")
    rows = a.P * (a.H if backward else a.OH)
    if rows > INT32_MAX or a.H * a.W > INT32_MAX:
        raise ValueError(f"P: {a.P} planes of {a.H}x{a.W} exceed the int32 row and plane indices")
    return check_grid(cdiv(rows, k.block_r) * cdiv(cdiv(written, k.lanes), k.block_g))


@triton.jit
def _split_lanes(v, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, N: tl.constexpr):
    """[BLOCK_R, BLOCK_G*N] -> 8-tuple of [BLOCK_R, BLOCK_G]: lane k holds column g*N + k (k < N;
    the rest repeat lane 0). Each split halves the in-thread group: even columns, odd columns."""
    if N == 1:
        return v, v, v, v, v, v, v, v
    elif N == 2:
        c0, c1 = tl.split(tl.reshape(v, [BLOCK_R, BLOCK_G, 2]))
        return c0, c1, c0, c0, c0, c0, c0, c0
    elif N == 4:
        even, odd = tl.split(tl.reshape(v, [BLOCK_R, BLOCK_G, 2, 2]))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return c0, c1, c2, c3, c0, c0, c0, c0
    else:
        even, odd = tl.split(tl.reshape(v, [BLOCK_R, BLOCK_G, 2, 2, 2]))
        even_even, even_odd = tl.split(even)
        odd_even, odd_odd = tl.split(odd)
        c0, c4 = tl.split(even_even)
        c2, c6 = tl.split(even_odd)
        c1, c5 = tl.split(odd_even)
        c3, c7 = tl.split(odd_odd)
        return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _join_lanes(o, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, N: tl.constexpr):
    """The inverse of `_split_lanes` for the first N lanes of the tuple o: [BLOCK_R, BLOCK_G*N]."""
    if N == 1:
        return o[0]
    elif N == 2:
        return tl.reshape(tl.join(o[0], o[1]), [BLOCK_R, BLOCK_G * 2])
    elif N == 4:
        return tl.reshape(tl.join(tl.join(o[0], o[2]), tl.join(o[1], o[3])), [BLOCK_R, BLOCK_G * 4])
    else:
        low = tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6]))
        high = tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7]))
        return tl.reshape(tl.join(low, high), [BLOCK_R, BLOCK_G * 8])


@triton.jit
def _add_lanes(a, b):
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5], a[6] + b[6], a[7] + b[7]


@triton.jit
def _row_lanes(src_row, row_ok, first_group, n_cols, SRC: tl.constexpr, VEC: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """Lanes (fp32, 0 outside the row) of groups first_group + [0, BLOCK_G) of the source rows
    src_row [BLOCK_R] (pointers to each row's column 0; row_ok masks whole rows), groups of SRC.
    VEC: aligned vector loads per group (n_cols % SRC == 0; two when SRC elements exceed 16 bytes); else one
    scalar load per lane."""
    if VEC:
        cols = first_group * SRC + tl.arange(0, BLOCK_G * SRC)
        group = first_group + tl.arange(0, BLOCK_G * SRC) // SRC
        ok = row_ok[:, None] & ((group >= 0) & (group < n_cols // SRC))[None, :]
        v = tl.load(src_row[:, None] + cols[None, :], mask=ok, other=0.0)
        return _split_lanes(v.to(tl.float32), BLOCK_R, BLOCK_G, SRC)
    else:
        cols = (first_group + tl.arange(0, BLOCK_G)) * SRC
        lanes = ()
        for k in tl.static_range(8):
            if k < SRC:
                c = cols + k
                ok = row_ok[:, None] & ((c >= 0) & (c < n_cols))[None, :]
                lanes = lanes + (tl.load(src_row[:, None] + c[None, :], mask=ok, other=0.0).to(tl.float32),)
            else:
                lanes = lanes + (lanes[0],)
        return lanes


@triton.jit
def _lanes_tile(columns, rows_per_plane, P, LANES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """This program's tile of rows r = plane*rows_per_plane + index over P planes (row tiles outer,
    tiles of BLOCK_G groups of LANES of the `columns` inner): (rows, first group, plane, index,
    whether the row exists)."""
    pid = tl.program_id(0)
    num_group_tiles = tl.cdiv(tl.cdiv(columns, LANES), BLOCK_G)
    rows = (pid // num_group_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    plane = rows // rows_per_plane
    return rows, (pid % num_group_tiles) * BLOCK_G, plane, rows - plane * rows_per_plane, rows < P * rows_per_plane


@triton.jit
def _lane(left, main, right, d: tl.constexpr, SRC: tl.constexpr):
    """Source lane d of a group, d in [-SRC, 2*SRC): from the left neighbour, the group, the right one."""
    if d < 0:
        return left[d + SRC]
    elif d < SRC:
        return main[d]
    else:
        return right[d - SRC]


@triton.jit
def avg_pool2d_lanes_forward(
    x, y, P, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, LANES: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """2-D average pooling forward from vector row loads (see the module docstring).

    Grid: pid = row_tile * cdiv(cdiv(OW, LANES), BLOCK_G) + group_tile over rows r = plane*OH + oh.
    One program writes y[plane, oh, ow] for BLOCK_R rows x BLOCK_G groups of LANES columns:
        V[c] = sum over kh with 0 <= ih = oh*STRIDE_H - PAD_H + kh < H of x[plane, ih, c] (0 outside),
        y[ow] = (1 / divisor(oh, ow)) * sum over kw < KW of V[ow*STRIDE_W - PAD_W + kw]
    with group g of y (ow = g*LANES + j) from x columns g*SRC + d, SRC = LANES*STRIDE_W,
    d = j*STRIDE_W - PAD_W + kw in [-SRC, 2*SRC). Divisor as in avg_pool2d_gather. Sums in fp32;
    every y is written. Contract (`forward_lane_widths`): SRC a power of two <= 8 dividing W.
    """
    SRC: tl.constexpr = LANES * STRIDE_W
    rows, first_group, plane, oh, row_in = _lanes_tile(OW, OH, P, LANES, BLOCK_R, BLOCK_G)
    h0 = oh * STRIDE_H - PAD_H
    zeros = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    main = (zeros, zeros, zeros, zeros, zeros, zeros, zeros, zeros)
    left = main
    right = main
    for kh in tl.static_range(KH):
        ih = h0 + kh
        x_row = x + tl.multiple_of((plane.to(tl.int64) * H + ih) * W, SRC)
        row_ok = row_in & (ih >= 0) & (ih < H)
        main = _add_lanes(main, _row_lanes(x_row, row_ok, first_group, W, SRC, True, BLOCK_R, BLOCK_G))
        # Windows of the group's first outputs start in the left group when there is column padding;
        # those of its last outputs end in the right group when KW > STRIDE_W + PAD_W.
        if PAD_W > 0:
            left = _add_lanes(left, _row_lanes(x_row, row_ok, first_group - 1, W, SRC, True, BLOCK_R, BLOCK_G))
        if KW - STRIDE_W - PAD_W > 0:
            right = _add_lanes(right, _row_lanes(x_row, row_ok, first_group + 1, W, SRC, True, BLOCK_R, BLOCK_G))
    out = ()
    for j in tl.static_range(8):
        s = zeros
        if j < LANES:
            for kw in tl.static_range(KW):
                s += _lane(left, main, right, j * STRIDE_W - PAD_W + kw, SRC)
        out = out + (s,)
    acc = _join_lanes(out, BLOCK_R, BLOCK_G, LANES)
    ow = first_group * LANES + tl.arange(0, BLOCK_G * LANES)
    acc = window_means(acc, h0, ow * STRIDE_W - PAD_W, H, W, KH, KW, PAD_H, PAD_W, COUNT_INCLUDE_PAD,
                       DIVISOR_OVERRIDE, UNIFORM)
    store_rows(y, rows, ow, OW, acc, row_in, ROW_ALIGN)


@triton.jit
def avg_pool2d_lanes_backward(
    dy, dx, P, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr, DIVISOR_OVERRIDE: tl.constexpr,
    UNIFORM: tl.constexpr, LANES: tl.constexpr, SRC_VEC: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """2-D average pooling backward from vector row loads, for one divisor D for every window
    (DIVISOR_OVERRIDE, or KH*KW when UNIFORM); gathers, so no atomics, no zero-init, deterministic.

    Grid: pid = row_tile * cdiv(cdiv(W, LANES), BLOCK_G) + group_tile over rows r = plane*H + ih.
    One program writes dx[plane, ih, iw] for BLOCK_R rows x BLOCK_G groups of LANES columns:
        V[ow] = sum over oh = (ih + PAD_H) // STRIDE_H - j (j < cdiv(KH, STRIDE_H)) with
                0 <= oh < OH and ih + PAD_H - oh*STRIDE_H < KH of dy[plane, oh, ow] (0 outside),
        dx[iw] = (1 / D) * sum over ow with 0 <= iw + PAD_W - ow*STRIDE_W < KW of V[ow]
    with group g of dx (iw = g*LANES + k) from dy columns g*SRC + m, SRC = LANES // STRIDE_W, m in
    [-SRC, 2*SRC). SRC_VEC: dy rows are vector-loaded (OW % SRC == 0). Every dx is written.
    """
    SRC: tl.constexpr = LANES // STRIDE_W
    rows, first_group, plane, ih, row_in = _lanes_tile(W, H, P, LANES, BLOCK_R, BLOCK_G)
    zeros = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.float32)
    main = (zeros, zeros, zeros, zeros, zeros, zeros, zeros, zeros)
    left = main
    right = main
    for j in tl.static_range((KH + STRIDE_H - 1) // STRIDE_H):
        oh, row_ok = covering_window(ih, j, row_in, OH, KH, STRIDE_H, PAD_H)
        dy_row = dy + (plane.to(tl.int64) * OH + oh) * OW
        if SRC_VEC:
            dy_row = dy + tl.multiple_of((plane.to(tl.int64) * OH + oh) * OW, SRC)
        main = _add_lanes(main, _row_lanes(dy_row, row_ok, first_group, OW, SRC, SRC_VEC, BLOCK_R, BLOCK_G))
        # The first dx of a group is covered by windows of the left group's dy when a window reaches
        # further left than PAD_W; its last dx by the right group's when there is column padding.
        if KW - 1 - PAD_W >= STRIDE_W:
            left = _add_lanes(left, _row_lanes(dy_row, row_ok, first_group - 1, OW, SRC, SRC_VEC, BLOCK_R, BLOCK_G))
        if PAD_W > 0:
            right = _add_lanes(right, _row_lanes(dy_row, row_ok, first_group + 1, OW, SRC, SRC_VEC, BLOCK_R, BLOCK_G))
    out = ()
    for k in tl.static_range(8):
        s = zeros
        if k < LANES:
            for m in tl.static_range(-SRC, 2 * SRC):
                if k + PAD_W - m * STRIDE_W >= 0 and k + PAD_W - m * STRIDE_W < KW:
                    s += _lane(left, main, right, m, SRC)
        out = out + (s,)
    acc = _join_lanes(out, BLOCK_R, BLOCK_G, LANES)
    if DIVISOR_OVERRIDE > 0:
        acc = acc * (1.0 / DIVISOR_OVERRIDE)
    else:
        acc = acc * (1.0 / (KH * KW))
    iw = first_group * LANES + tl.arange(0, BLOCK_G * LANES)
    store_rows(dx, rows, iw, W, acc, row_in, ROW_ALIGN)


_HELPERS = (_lanes_tile, _split_lanes, _join_lanes, _add_lanes, _row_lanes, _lane, covering_window, window_means,
            window_divisor, store_rows, columns_in)
_OPTIONS = dict(
    entry=avg_pool2d_lanes_entry,
    nonnegative=("PAD_H", "PAD_W", "DIVISOR_OVERRIDE"),
    flags=("COUNT_INCLUDE_PAD", "UNIFORM", "SRC_VEC"),
    helpers=_HELPERS,
)
AvgPool2dLanesForward = kernel_object(
    avg_pool2d_lanes_forward, example=(3, 3, 1, 1, 1, 1, True, 0, True, 4, 4, 32, 16), **_OPTIONS)
AvgPool2dLanesBackward = kernel_object(
    avg_pool2d_lanes_backward, example=(3, 3, 1, 1, 1, 1, True, 0, True, 4, True, 4, 32, 16), **_OPTIONS)
