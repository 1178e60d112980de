"""Winograd F(2x2, 3x3) transforms for 3x3 convolutions with stride 1 and padding 1 (no dilation, one group).

Each 2x2 block of outputs (a tile; the plane's tiles t = (b*TH + ty)*TW + tx, TH = cdiv(H, 2), TW = cdiv(W,
2), output planes = input planes) is, for a [3, 3] filter g and the 4x4 input patch d at rows 2ty-1.., cols
2tx-1.. (0 outside the image),
    y_tile = A^T [(G g G^T) . (B^T d B)] A     (. elementwise over the 16 Winograd points k = 4i + j)
with B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], G = [[1, 0, 0], [1/2, 1/2, 1/2],
[1/2, -1/2, 1/2], [0, 0, 1]], A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]. Summed over input channels, every point is
one matrix product over C_IN (`Conv2dWinogradProducts`): 16 products of 4 tiles' worth each, against 9
products per output for the direct convolution, 2.25x fewer multiplications. The weight gradient follows
from the same identity: dw = G^T [sum over tiles of (B^T d B) . (A dy_tile A^T)] G.

These kernels move tiles between the NCHW tensors and the [16, ...] fp32 matrices the products take:
`Conv2dWinogradInput` (x or dy -> B^T d B), `Conv2dWinogradWeight` (w -> G g G^T), `Conv2dWinogradDy`
(dy -> A dy A^T) and `Conv2dWinogradOutput` (A^T m A -> y, plus bias). Transforms add and subtract, so an Inf
input can come out NaN where the direct convolution gives +-Inf.
"""
import torch
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_grid_3d, check_numel
from ..common.host_math import cdiv

POINTS = 16  # Winograd points of F(2x2, 3x3): 4x4 per tile


def tiles_of(batch, height, width):
    """Output tiles (2x2 blocks) of a [batch, *, height, width] stride-1 3x3 pad-1 convolution."""
    return batch * cdiv(height, 2) * cdiv(width, 2)


def check_plane_launch(a, plane_name, plane, matrix_name, matrix):
    """Check a transform's NCHW tensor (B*C*H*W elements) and its [16, T, C] matrix (16*T*C, int32-indexed);
    return T."""
    tiles = tiles_of(a.B, a.H, a.W)
    if POINTS * tiles * a.C > INT32_MAX:
        raise ValueError(f"C: expected 16*T*C <= 2**31 - 1 (T = B*cdiv(H, 2)*cdiv(W, 2) = {tiles}), got C = {a.C}")
    check_numel(plane_name, plane, a.B * a.C * a.H * a.W, "B*C*H*W")
    check_numel(matrix_name, matrix, POINTS * tiles * a.C, "16*T*C, T = B*cdiv(H, 2)*cdiv(W, 2)")
    return tiles


def transform_grid(k, a, plane_name, plane, matrix_name, matrix):
    """Grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1) of the tile transforms."""
    tiles = check_plane_launch(a, plane_name, plane, matrix_name, matrix)
    return check_grid_3d(cdiv(tiles, k.block_t), cdiv(a.C, k.block_c), 1)


@triton.jit
def _tile_coordinates(TH, TW, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, C, T, T_MAJOR: tl.constexpr):
    """This program's tiles and channels as a [BLOCK_T, BLOCK_C] grid (T_MAJOR) or [BLOCK_C, BLOCK_T]: (t, c,
    b, ty, tx, inside)."""
    if T_MAJOR:
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    else:
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    tx = t % TW
    ty = (t // TW) % TH
    b = t // (TW * TH)
    return t, c, b, ty, tx, (t < T) & (c < C)


@triton.jit
def _bt_rows(d0, d1, d2, d3):
    """B^T applied to four values: (d0 - d2, d1 + d2, d2 - d1, d1 - d3)."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@triton.jit
def _patch_row(row_base, c0, W, ok):
    """Four neighbouring x values from column c0 of one row, 0 outside [0, W)."""
    v0 = tl.load(row_base + c0, mask=ok & (c0 >= 0), other=0.0).to(tl.float32)
    v1 = tl.load(row_base + c0 + 1, mask=ok, other=0.0).to(tl.float32)
    v2 = tl.load(row_base + c0 + 2, mask=ok & (c0 + 2 < W), other=0.0).to(tl.float32)
    v3 = tl.load(row_base + c0 + 3, mask=ok & (c0 + 3 < W), other=0.0).to(tl.float32)
    return v0, v1, v2, v3


@triton.jit
def _store_points(out, point_stride, first, f0, f1, f2, f3, ok):
    """Stores f0..f3 as points first..first+3 of the matrices at `out` (`load_points`' counterpart)."""
    tl.store(out + first * point_stride, f0, mask=ok)
    tl.store(out + (first + 1) * point_stride, f1, mask=ok)
    tl.store(out + (first + 2) * point_stride, f2, mask=ok)
    tl.store(out + (first + 3) * point_stride, f3, mask=ok)


@triton.jit
def _store_bt_row(out, point_stride, first, e0, e1, e2, e3, ok):
    """Stores B^T applied to (e0, e1, e2, e3) as points first..first+3."""
    f0, f1, f2, f3 = _bt_rows(e0, e1, e2, e3)
    _store_points(out, point_stride, first, f0, f1, f2, f3, ok)


def conv2d_winograd_input_entry(k, a):
    """Grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1) for `Conv2dWinogradInput`."""
    return transform_grid(k, a, "x", a.x, "u", a.u)


@triton.jit
def conv2d_winograd_input(x, u, B, C, H, W, T_MAJOR: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Winograd input transform: u = B^T d B for every tile of x (3x3, stride 1, padding 1).

    Grid: (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1), T = B*TH*TW, TH = cdiv(H, 2), TW = cdiv(W, 2).
    Program (i, j) takes tiles t in [i*BLOCK_T, (i+1)*BLOCK_T) and channels c in [j*BLOCK_C, (j+1)*BLOCK_C) and
    writes, for the 16 points k = 4*r + s,
        u[k, t, c] (T_MAJOR) or u[k, c, t] = sum over p, q of B^T[r, p] * x[b, c, 2ty - 1 + p, 2tx - 1 + q]
            * B^T[s, q]   (x read as 0 outside the image),  t = (b*TH + ty)*TW + tx,
    in fp32. [16, T, C] is the forward's operand (its products reduce over C), [16, C, T] the weight
    gradient's (they reduce over T). Every element of u is written.
    """
    TH = (H + 1) // 2
    TW = (W + 1) // 2
    T = B * TH * TW
    t, c, b, ty, tx, ok = _tile_coordinates(TH, TW, BLOCK_T, BLOCK_C, C, T, T_MAJOR)
    plane = x + (b.to(tl.int64) * C + c) * H * W
    r0 = 2 * ty - 1
    c0 = 2 * tx - 1
    d00, d01, d02, d03 = _patch_row(plane + r0 * W, c0, W, ok & (r0 >= 0))
    d10, d11, d12, d13 = _patch_row(plane + (r0 + 1) * W, c0, W, ok)
    d20, d21, d22, d23 = _patch_row(plane + (r0 + 2) * W, c0, W, ok & (r0 + 2 < H))
    d30, d31, d32, d33 = _patch_row(plane + (r0 + 3) * W, c0, W, ok & (r0 + 3 < H))
    # e = B^T d, one column at a time
    e00, e10, e20, e30 = _bt_rows(d00, d10, d20, d30)
    e01, e11, e21, e31 = _bt_rows(d01, d11, d21, d31)
    e02, e12, e22, e32 = _bt_rows(d02, d12, d22, d32)
    e03, e13, e23, e33 = _bt_rows(d03, d13, d23, d33)
    if T_MAJOR:
        out = u + t * C + c
    else:
        out = u + c * T + t
    point_stride = T * C
    _store_bt_row(out, point_stride, 0, e00, e01, e02, e03, ok)
    _store_bt_row(out, point_stride, 4, e10, e11, e12, e13, ok)
    _store_bt_row(out, point_stride, 8, e20, e21, e22, e23, ok)
    _store_bt_row(out, point_stride, 12, e30, e31, e32, e33, ok)


def conv2d_winograd_dy_entry(k, a):
    """Grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1) for `Conv2dWinogradDy`."""
    return transform_grid(k, a, "dy", a.dy, "d", a.d)


@triton.jit
def _a_rows(g0, g1):
    """A applied to two values: (g0, g0 + g1, g0 - g1, -g1)."""
    return g0, g0 + g1, g0 - g1, -g1


@triton.jit
def _store_a_columns(out, point_stride, first, h0, h1, ok):
    """Stores A applied to (h0, h1) as points first..first+3."""
    f0, f1, f2, f3 = _a_rows(h0, h1)
    _store_points(out, point_stride, first, f0, f1, f2, f3, ok)


@triton.jit
def conv2d_winograd_dy(dy, d, B, C, H, W, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Winograd transform of the output gradient for the weight gradient: d = A g A^T per 2x2 block g of dy.

    Grid: (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1), T = B*TH*TW, TH = cdiv(H, 2), TW = cdiv(W, 2) (H, W: dy's).
    Program (i, j) takes tiles t in [i*BLOCK_T, (i+1)*BLOCK_T) and channels c in [j*BLOCK_C, (j+1)*BLOCK_C) and
    writes, for the 16 points k = 4*r + s,
        d[k, c, t] = sum over p, q < 2 of A[r, p] * dy[b, c, 2ty + p, 2tx + q] * A[s, q]   (dy read as 0 outside)
    with A = [[1, 0], [1, 1], [1, -1], [0, -1]], in fp32. Point 5 is the sum of the block: its row sums are the
    bias gradient. Every element of d is written.
    """
    TH = (H + 1) // 2
    TW = (W + 1) // 2
    T = B * TH * TW
    t, c, b, ty, tx, ok = _tile_coordinates(TH, TW, BLOCK_T, BLOCK_C, C, T, False)
    r = 2 * ty
    q = 2 * tx
    src = dy + (b.to(tl.int64) * C + c) * H * W + r * W + q
    g00 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    g01 = tl.load(src + 1, mask=ok & (q + 1 < W), other=0.0).to(tl.float32)
    g10 = tl.load(src + W, mask=ok & (r + 1 < H), other=0.0).to(tl.float32)
    g11 = tl.load(src + W + 1, mask=ok & (r + 1 < H) & (q + 1 < W), other=0.0).to(tl.float32)
    h00, h10, h20, h30 = _a_rows(g00, g10)
    h01, h11, h21, h31 = _a_rows(g01, g11)
    out = d + c * T + t
    point_stride = T * C
    _store_a_columns(out, point_stride, 0, h00, h01, ok)
    _store_a_columns(out, point_stride, 4, h10, h11, ok)
    _store_a_columns(out, point_stride, 8, h20, h21, ok)
    _store_a_columns(out, point_stride, 12, h30, h31, ok)


def conv2d_winograd_output_entry(k, a):
    """Grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1) for `Conv2dWinogradOutput`."""
    if k.has_bias:
        check_numel("bias", a.bias, a.C, "C")
    return transform_grid(k, a, "y", a.y, "m", a.m)


@triton.jit
def _at_rows(m0, m1, m2, m3):
    """A^T applied to four values: (m0 + m1 + m2, m1 - m2 - m3)."""
    return m0 + m1 + m2, m1 - m2 - m3


@triton.jit
def conv2d_winograd_output(m, bias, y, B, C, H, W, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """Winograd output transform: every 2x2 output block from its tile's 16 products, plus the bias.

    Grid: (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), 1), T = B*TH*TW, TH = cdiv(H, 2), TW = cdiv(W, 2) (H, W: y's).
    Program (i, j) takes tiles t in [i*BLOCK_T, (i+1)*BLOCK_T) and channels c in [j*BLOCK_C, (j+1)*BLOCK_C) and
    writes, for p, q < 2 inside the plane,
        y[b, c, 2ty + p, 2tx + q] = sum over r, s of A^T[p, r] * m[4r + s, c, t] * A^T[q, s]  (+ bias[c])
    accumulated in fp32, rounded once. Each output row's two values per tile are interleaved into one store,
    so that neighbouring lanes write neighbouring addresses: stores two elements apart were far slower
    (docs/notes.md, "Winograd F(2x2, 3x3), full fp32"). Every element of y is written.
    """
    TH = (H + 1) // 2
    TW = (W + 1) // 2
    T = B * TH * TW
    t, c, b, ty, tx, ok = _tile_coordinates(TH, TW, BLOCK_T, BLOCK_C, C, T, False)
    source = m + c * T + t
    point_stride = T * C
    # a_rs = m[4r + s]: A^T down each column s, then across
    a00, a01, a02, a03 = load_points(source, point_stride, 0, ok)
    a10, a11, a12, a13 = load_points(source, point_stride, 4, ok)
    a20, a21, a22, a23 = load_points(source, point_stride, 8, ok)
    a30, a31, a32, a33 = load_points(source, point_stride, 12, ok)
    top0, bottom0 = _at_rows(a00, a10, a20, a30)
    top1, bottom1 = _at_rows(a01, a11, a21, a31)
    top2, bottom2 = _at_rows(a02, a12, a22, a32)
    top3, bottom3 = _at_rows(a03, a13, a23, a33)
    o00, o01 = _at_rows(top0, top1, top2, top3)
    o10, o11 = _at_rows(bottom0, bottom1, bottom2, bottom3)
    if HAS_BIAS:
        channel_bias = tl.load(bias + c, mask=c < C).to(tl.float32)
        o00 += channel_bias
        o01 += channel_bias
        o10 += channel_bias
        o11 += channel_bias
    top = tl.interleave(o00, o01)  # [BLOCK_C, 2*BLOCK_T]: tile t's two values at 2t and 2t + 1
    bottom = tl.interleave(o10, o11)
    e = tl.arange(0, 2 * BLOCK_T)[None, :]
    te = tl.program_id(0) * BLOCK_T + e // 2
    q = 2 * (te % TW) + e % 2
    r = 2 * ((te // TW) % TH)
    be = te // (TW * TH)
    inside = (te < T) & (c < C) & (q < W)
    dst = y + (be.to(tl.int64) * C + c) * H * W + r * W + q
    tl.store(dst, top.to(y.dtype.element_ty), mask=inside)
    tl.store(dst + W, bottom.to(y.dtype.element_ty), mask=inside & (r + 1 < H))


@triton.jit
def load_points(source, point_stride, first, ok):
    """Points first..first+3 of the tiles at `source`."""
    m0 = tl.load(source + first * point_stride, mask=ok)
    m1 = tl.load(source + (first + 1) * point_stride, mask=ok)
    m2 = tl.load(source + (first + 2) * point_stride, mask=ok)
    m3 = tl.load(source + (first + 3) * point_stride, mask=ok)
    return m0, m1, m2, m3


def conv2d_winograd_weight_entry(k, a):
    """Grid (cdiv(C_OUT*C_IN, BLOCK), 1, 1) for `Conv2dWinogradWeight`."""
    pairs = a.C_OUT * a.C_IN
    if POINTS * pairs > INT32_MAX:
        raise ValueError(f"C_IN: expected 16*C_OUT*C_IN <= 2**31 - 1, got C_OUT = {a.C_OUT}, C_IN = {a.C_IN}")
    check_numel("w", a.w, pairs * 9, "C_OUT*C_IN*3*3")
    check_numel("v", a.v, POINTS * pairs, "16*C_OUT*C_IN")
    return check_grid_3d(cdiv(pairs, k.block), 1, 1)


@triton.jit
def _g_rows(f0, f1, f2):
    """G applied to three values: (f0, (f0 + f1 + f2)/2, (f0 - f1 + f2)/2, f2)."""
    return f0, 0.5 * (f0 + f1 + f2), 0.5 * (f0 - f1 + f2), f2


@triton.jit
def _store_g_row(out, point_stride, first, h0, h1, h2, ok):
    """Stores G applied to (h0, h1, h2) as points first..first+3."""
    f0, f1, f2, f3 = _g_rows(h0, h1, h2)
    _store_points(out, point_stride, first, f0, f1, f2, f3, ok)


@triton.jit
def conv2d_winograd_weight(w, v, C_OUT, C_IN, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr):
    """Winograd filter transform: v = G f G^T for every filter f of w [C_OUT, C_IN, 3, 3].

    Grid: (cdiv(C_OUT*C_IN, BLOCK), 1, 1). Program i takes the pairs p = mm*N + n in [i*BLOCK, (i+1)*BLOCK) and
    writes, for the 16 points k = 4*r + s,
        v[k, mm, n] = sum over a, b < 3 of G[r, a] * f[a, b] * G[s, b]
    with f = w[mm, n] (mm = c_out, n = c_in, N = C_IN), or, when TRANSPOSE, f[a, b] = w[n, mm, 2 - a, 2 - b]
    (mm = c_in, n = c_out, N = C_OUT): the filter of dx as a stride-1 pad-1 convolution of dy. In fp32.
    Every element of v is written.
    """
    pairs = C_OUT * C_IN
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < pairs
    if TRANSPOSE:
        source = w + ((p % C_OUT) * C_IN + p // C_OUT) * 9 + 8
        tap_step = -1
    else:
        source = w + p * 9
        tap_step = 1
    f00 = tl.load(source, mask=ok).to(tl.float32)
    f01 = tl.load(source + tap_step, mask=ok).to(tl.float32)
    f02 = tl.load(source + 2 * tap_step, mask=ok).to(tl.float32)
    f10 = tl.load(source + 3 * tap_step, mask=ok).to(tl.float32)
    f11 = tl.load(source + 4 * tap_step, mask=ok).to(tl.float32)
    f12 = tl.load(source + 5 * tap_step, mask=ok).to(tl.float32)
    f20 = tl.load(source + 6 * tap_step, mask=ok).to(tl.float32)
    f21 = tl.load(source + 7 * tap_step, mask=ok).to(tl.float32)
    f22 = tl.load(source + 8 * tap_step, mask=ok).to(tl.float32)
    # h = G f (4 x 3), one column at a time
    h00, h10, h20, h30 = _g_rows(f00, f10, f20)
    h01, h11, h21, h31 = _g_rows(f01, f11, f21)
    h02, h12, h22, h32 = _g_rows(f02, f12, f22)
    out = v + p
    _store_g_row(out, pairs, 0, h00, h01, h02, ok)
    _store_g_row(out, pairs, 4, h10, h11, h12, ok)
    _store_g_row(out, pairs, 8, h20, h21, h22, ok)
    _store_g_row(out, pairs, 12, h30, h31, h32, ok)


def _transform(jitted, fp32, **declared):
    """The kernel class of a transform: `jitted`, whose pointer `fp32` is an fp32 [16, ...] matrix, in one pipeline
    stage (a transform has no loop to pipeline)."""
    return kernel_object(jitted, pointer_dtypes={fp32: torch.float32}, num_stages=1, **declared)


Conv2dWinogradInput = _transform(
    conv2d_winograd_input, "u",
    helpers=(_tile_coordinates, _bt_rows, _patch_row, _store_bt_row, _store_points),
    example=(True, 32, 32),
    entry=conv2d_winograd_input_entry,
    flags=("T_MAJOR",),
)
Conv2dWinogradDy = _transform(
    conv2d_winograd_dy, "d",
    helpers=(_tile_coordinates, _a_rows, _store_a_columns, _store_points),
    example=(128, 8),
    entry=conv2d_winograd_dy_entry,
)
Conv2dWinogradOutput = _transform(
    conv2d_winograd_output, "m",
    helpers=(_tile_coordinates, load_points, _at_rows),
    example=(False, 64, 16),
    entry=conv2d_winograd_output_entry,
    flags=("HAS_BIAS",),
)
Conv2dWinogradWeight = _transform(
    conv2d_winograd_weight, "v",
    helpers=(_g_rows, _store_g_row, _store_points),
    example=(False, 256),
    entry=conv2d_winograd_weight_entry,
    flags=("TRANSPOSE",),
)
