"""The 16 matrix products of Winograd F(2x2, 3x3) convolutions, and the weight gradient's last step.

`Conv2dWinogradProducts` multiplies, for each Winograd point z < 16, a [M, K] matrix by a [N, K] one (both
contiguous along K, the layout TF32 tensor cores read): the forward's transformed filters [16, C_OUT, C_IN] by
the transformed input [16, T, C_IN], and the weight gradient's transformed dy [16, C_OUT, T] by the input
[16, C_IN, T], there split over T into fp32 partials. `Conv2dWinogradDwFinish` adds the partials in a fixed
order and maps each 4x4 point matrix back to a 3x3 filter: dw = G^T M G. See `conv2d_winograd` for the
algebra.
"""
import torch
import triton
import triton.language as tl

from ...kernel import INT32_MAX, kernel_object
from ..common.checks import check_grid_3d, check_numel
from .winograd_transforms import POINTS, load_points
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot, sums_beside_dot

def products_row_size(m, n, has_bias):
    """fp32 elements of one split's row of `c`: 16 [M, N] products, then M bias sums when `has_bias`."""
    return POINTS * m * n + (m if has_bias else 0)


@triton.jit
def _row_length(M, N, HAS_BIAS: tl.constexpr):
    """`products_row_size` in a kernel."""
    if HAS_BIAS:
        return 16 * M * N + M
    return 16 * M * N


def conv2d_winograd_products_entry(k, a):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), 16, SPLIT) for `Conv2dWinogradProducts`."""
    if a.SPLIT > a.K:
        raise ValueError(f"SPLIT: expected at most K = {a.K} slices, got {a.SPLIT}")
    row = products_row_size(a.M, a.N, k.has_bias)
    for name, tensor, numel, formula in (("a", a.a, POINTS * a.M * a.K, "16*M*K"),
                                         ("b", a.b, POINTS * a.N * a.K, "16*N*K"),
                                         ("c", a.c, a.SPLIT * row, "SPLIT*(16*M*N [+ M with HAS_BIAS])")):
        if numel > INT32_MAX:
            raise ValueError(f"{name}: expected {formula} <= 2**31 - 1 elements, got {numel}")
        check_numel(name, tensor, numel, formula)
    return check_grid_3d(cdiv(a.M, k.block_m) * cdiv(a.N, k.block_n), POINTS, a.SPLIT)


@triton.jit
def conv2d_winograd_products(a, b, c, M, N, K, SPLIT, HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """16 batched matrix products a[z] @ b[z]^T, split over K, on tensor cores.

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), 16, SPLIT). Program (tile, z, s) takes rows m and columns n of
    its [BLOCK_M, BLOCK_N] tile and the K slice [s*L, min((s+1)*L, K)), L = cdiv(cdiv(K, SPLIT), BLOCK_K)*BLOCK_K,
    and writes, in row s of c (`products_row_size` long),
        c[s, z*M*N + m*N + n] = sum over k in the slice of a[z, m, k] * b[z, n, k]
    and, when HAS_BIAS, the programs of point 5 and the first column tile also
        c[s, 16*M*N + m] = sum over k in the slice of a[5, m, k]   (the bias gradient's share, see `Conv2dWinogradDy`).
    Products `conv_dot` (fp32 as TF32 or tf32x3), fp32 sums. Every element of c is written.
    """
    pid = tl.program_id(0)
    z = tl.program_id(1)
    split = tl.program_id(2)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tile_n = pid % num_n_tiles
    rm = (pid // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    slice_len = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_first = split * slice_len
    k_end = tl.minimum(K, k_first + slice_len)
    a_rows = a + z * M * K + rm[:, None] * K
    b_rows = b + z * N * K + rn[None, :] * K
    sums_bias = (z == 5) & (tile_n == 0)  # used only when HAS_BIAS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_first, k_end, BLOCK_K):
        ks = k + rk
        a_tile_ok = (rm < M)[:, None] & (ks < k_end)[None, :]
        a_tile = tl.load(a_rows + ks[None, :], mask=a_tile_ok, other=0.0)
        b_tile = tl.load(b_rows + ks[:, None], mask=(ks < k_end)[:, None] & (rn < N)[None, :], other=0.0)
        acc = conv_dot(a_tile, b_tile, acc, TF32)
        if HAS_BIAS:
            if sums_bias:
                row_sums = sums_beside_dot(row_sums, a_rows + ks[None, :], a_tile_ok, 1)
    row = c + split.to(tl.int64) * _row_length(M, N, HAS_BIAS)
    tl.store(row + z * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
    if HAS_BIAS:
        if sums_bias:
            tl.store(row + 16 * M * N + rm, row_sums, mask=rm < M)


def conv2d_winograd_dw_finish_entry(k, a):
    """Grid (cdiv(C_OUT*C_IN, BLOCK), 1, 1) for `Conv2dWinogradDwFinish`."""
    pairs = a.C_OUT * a.C_IN
    check_numel("partial", a.partial, a.SPLIT * products_row_size(a.C_OUT, a.C_IN, k.has_bias),
                "SPLIT*(16*C_OUT*C_IN [+ C_OUT with HAS_BIAS])")
    check_numel("dw", a.dw, pairs * 9, "C_OUT*C_IN*3*3")
    if k.has_bias:
        check_numel("dbias", a.dbias, a.C_OUT, "C_OUT")
    return check_grid_3d(cdiv(pairs, k.block), 1, 1)


@triton.jit
def _gt_rows(m0, m1, m2, m3):
    """G^T applied to four values: (m0 + (m1 + m2)/2, (m1 - m2)/2, (m1 + m2)/2 + m3)."""
    return m0 + 0.5 * (m1 + m2), 0.5 * (m1 - m2), 0.5 * (m1 + m2) + m3


@triton.jit
def _store_gt_row(out, first_tap, h0, h1, h2, h3, ok):
    """Stores G^T applied to (h0, h1, h2, h3) as taps first_tap..first_tap+2 of 9-tap filters at `out`."""
    f0, f1, f2 = _gt_rows(h0, h1, h2, h3)
    tl.store(out + first_tap, f0.to(out.dtype.element_ty), mask=ok)
    tl.store(out + first_tap + 1, f1.to(out.dtype.element_ty), mask=ok)
    tl.store(out + first_tap + 2, f2.to(out.dtype.element_ty), mask=ok)


@triton.jit
def conv2d_winograd_dw_finish(partial, dw, dbias, SPLIT, C_OUT, C_IN, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Weight (and bias) gradient from the split Winograd products: ordered sum, then back to 3x3 filters.

    Grid: (cdiv(C_OUT*C_IN, BLOCK), 1, 1). Program i takes the pairs p = c_out*C_IN + c_in in [i*BLOCK,
    (i+1)*BLOCK) and, with M[k] = sum over s < SPLIT, in split order, of partial[s, k*C_OUT*C_IN + p], writes
        dw[c_out, c_in, a, b] = sum over r, s of G^T[a, r] * M[4r + s] * G[s, b]   (dw = G^T M G)
    and, when HAS_BIAS, for its p < C_OUT, dbias[p] = sum over s of partial[s, 16*C_OUT*C_IN + p]. Sums in
    fp32 (the same order every run), rounded once. Every element of dw (and dbias) is written.
    """
    pairs = C_OUT * C_IN
    row_len = _row_length(C_OUT, C_IN, HAS_BIAS)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < pairs
    m00 = tl.zeros((BLOCK,), dtype=tl.float32)
    m01 = tl.zeros((BLOCK,), dtype=tl.float32)
    m02 = tl.zeros((BLOCK,), dtype=tl.float32)
    m03 = tl.zeros((BLOCK,), dtype=tl.float32)
    m10 = tl.zeros((BLOCK,), dtype=tl.float32)
    m11 = tl.zeros((BLOCK,), dtype=tl.float32)
    m12 = tl.zeros((BLOCK,), dtype=tl.float32)
    m13 = tl.zeros((BLOCK,), dtype=tl.float32)
    m20 = tl.zeros((BLOCK,), dtype=tl.float32)
    m21 = tl.zeros((BLOCK,), dtype=tl.float32)
    m22 = tl.zeros((BLOCK,), dtype=tl.float32)
    m23 = tl.zeros((BLOCK,), dtype=tl.float32)
    m30 = tl.zeros((BLOCK,), dtype=tl.float32)
    m31 = tl.zeros((BLOCK,), dtype=tl.float32)
    m32 = tl.zeros((BLOCK,), dtype=tl.float32)
    m33 = tl.zeros((BLOCK,), dtype=tl.float32)
    source = partial + p
    for _ in range(0, SPLIT):
        p00, p01, p02, p03 = load_points(source, pairs, 0, ok)
        p10, p11, p12, p13 = load_points(source, pairs, 4, ok)
        p20, p21, p22, p23 = load_points(source, pairs, 8, ok)
        p30, p31, p32, p33 = load_points(source, pairs, 12, ok)
        m00 += p00
        m01 += p01
        m02 += p02
        m03 += p03
        m10 += p10
        m11 += p11
        m12 += p12
        m13 += p13
        m20 += p20
        m21 += p21
        m22 += p22
        m23 += p23
        m30 += p30
        m31 += p31
        m32 += p32
        m33 += p33
        source += row_len  # a pointer step: the rows together may pass 2**31 elements
    # h = G^T M (3 x 4), one column at a time; then G^T down each of its rows
    h00, h10, h20 = _gt_rows(m00, m10, m20, m30)
    h01, h11, h21 = _gt_rows(m01, m11, m21, m31)
    h02, h12, h22 = _gt_rows(m02, m12, m22, m32)
    h03, h13, h23 = _gt_rows(m03, m13, m23, m33)
    out = dw + p * 9
    _store_gt_row(out, 0, h00, h01, h02, h03, ok)
    _store_gt_row(out, 3, h10, h11, h12, h13, ok)
    _store_gt_row(out, 6, h20, h21, h22, h23, ok)
    if HAS_BIAS:
        if tl.program_id(0) * BLOCK < C_OUT:
            bias_ok = p < C_OUT
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            source = partial + 16 * pairs + p
            for _ in range(0, SPLIT):
                total += tl.load(source, mask=bias_ok)
                source += row_len
            tl.store(dbias + p, total.to(dbias.dtype.element_ty), mask=bias_ok)


Conv2dWinogradProducts = kernel_object(
    conv2d_winograd_products,
    helpers=(conv_dot, sums_beside_dot, _row_length),
    example=(False, False, 128, 64, 32),
    entry=conv2d_winograd_products_entry,
    flags=("HAS_BIAS", "TF32"),
    num_stages=4,
)
Conv2dWinogradDwFinish = kernel_object(
    conv2d_winograd_dw_finish,
    helpers=(_row_length, load_points, _gt_rows, _store_gt_row),
    example=(False, 256),
    entry=conv2d_winograd_dw_finish_entry,
    flags=("HAS_BIAS",),
    pointer_dtypes={"partial": torch.float32},
    num_stages=1,
)
