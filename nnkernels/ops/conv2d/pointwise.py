"""1x1 convolution (stride 1, no padding, one group) as a batched matrix product on NCHW:
`Conv2dPointwise` (forward, and dx with the transposed weight), `Conv2dPointwiseFp32Out` (the same
product kept in fp32) and `Conv2dPointwiseDw`.

For one image, x[b] is a row-major [C_IN, HW] matrix and y[b] = w @ x[b] with w [C_OUT, C_IN].
Every tile load is a run of consecutive pixels of one channel, so the loads are wide and the
compiler pipelines them; the general implicit-GEMM kernels gather with per-element masks and
ran these layers at 0.1x cuDNN's speed on the H200.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid, check_grid_3d, check_numel
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot, tf32_rounded


def conv2d_pointwise_fp32_out_entry(k, a):
    """Grid (B * cdiv(HW, block_n), cdiv(C_OUT, block_m * max(1, m_tiles))) for `Conv2dPointwiseFp32Out`."""
    check_numel("x", a.x, a.B * a.C_IN * a.HW, "B*C_IN*HW")
    check_numel("w", a.w, a.C_OUT * a.C_IN, "C_OUT*C_IN")
    check_numel("y", a.y, a.B * a.C_OUT * a.HW, "B*C_OUT*HW")
    if k.m_tiles and a.C_IN > k.block_k:
        raise ValueError(f"C_IN: expected at most block_k = {k.block_k} (with m_tiles the whole reduction is one "
                         f"tile), got {a.C_IN}")
    return check_grid_3d(a.B * cdiv(a.HW, k.block_n), cdiv(a.C_OUT, k.block_m * max(1, k.m_tiles)), 1)


def conv2d_pointwise_entry(k, a):
    """Grid (B * cdiv(HW, block_n), cdiv(C_OUT, block_m * max(1, m_tiles))) for `Conv2dPointwise`."""
    if k.has_bias:
        check_numel("bias", a.bias, a.C_OUT, "C_OUT")
    return conv2d_pointwise_fp32_out_entry(k, a)


@triton.jit
def image_pixel_tile(HW, BLOCK_N: tl.constexpr):
    """(b, pixel, pixel_ok) of the 1x1 products' axis 0, b * cdiv(HW, BLOCK_N) + tile: the image and the
    BLOCK_N consecutive pixels of its tile (the compiler told they are), those inside the plane."""
    pixel_tiles = tl.cdiv(HW, BLOCK_N)
    pixel = (tl.program_id(0) % pixel_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    pixel = tl.max_contiguous(tl.multiple_of(pixel, BLOCK_N), BLOCK_N)
    return tl.program_id(0) // pixel_tiles, pixel, pixel < HW


@triton.jit
def weight_offsets(c_out, k, C_IN, C_OUT, W_TRANSPOSED: tl.constexpr):
    """(offsets of w[c_out, k] broadcast over the shapes of c_out and k, the offset of one step of k): w is
    [C_OUT, C_IN] row-major, or with W_TRANSPOSED its transpose stored [C_IN, C_OUT] row-major (the forward's
    own weight, read by dx without a transposed copy)."""
    if W_TRANSPOSED:
        return c_out.to(tl.int64) + k.to(tl.int64) * C_OUT, C_OUT
    return c_out.to(tl.int64) * C_IN + k, 1


@triton.jit
def pointwise_product(
    x, w, bias, y, B, C_IN, C_OUT, HW,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_TRANSPOSED: tl.constexpr,
):
    """The body of `conv2d_pointwise` with M_TILES = 0 (see there), y stored in its own element type."""
    b, pixel, pixel_ok = image_pixel_tile(HW, BLOCK_N)
    c_out = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_out_ok = c_out < C_OUT
    k = tl.arange(0, BLOCK_K)
    x_tile_ptr = x + b.to(tl.int64) * C_IN * HW + k[:, None].to(tl.int64) * HW + pixel[None, :]
    w_offsets, k_step = weight_offsets(c_out[:, None], k[None, :], C_IN, C_OUT, W_TRANSPOSED)
    w_tile_ptr = w + w_offsets
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_first in range(0, C_IN, BLOCK_K):
        k_ok = (k_first + k) < C_IN
        x_tile = tl.load(x_tile_ptr, mask=k_ok[:, None] & pixel_ok[None, :], other=0.0)
        w_tile = tl.load(w_tile_ptr, mask=c_out_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w_tile, x_tile, acc, input_precision="ieee")
        x_tile_ptr += BLOCK_K * HW
        w_tile_ptr += BLOCK_K * k_step
    if HAS_BIAS:
        acc += tl.load(bias + c_out, mask=c_out_ok, other=0.0).to(tl.float32)[:, None]
    y_tile_ptr = y + (b.to(tl.int64) * C_OUT + c_out[:, None]) * HW + pixel[None, :]
    tl.store(y_tile_ptr, acc.to(y.dtype.element_ty), mask=c_out_ok[:, None] & pixel_ok[None, :])


@triton.jit
def pointwise_whole_k_product(
    x, w, bias, y, B, C_IN, C_OUT, HW,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    M_TILES: tl.constexpr, W_TRANSPOSED: tl.constexpr,
):
    """The body of `conv2d_pointwise` with M_TILES > 0 (C_IN <= BLOCK_K): the x tile, the whole reduction,
    is loaded once and serves M_TILES channel tiles in turn."""
    b, pixel, pixel_ok = image_pixel_tile(HW, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < C_IN
    x_tile = tl.load(x + b.to(tl.int64) * C_IN * HW + k[:, None].to(tl.int64) * HW + pixel[None, :],
                     mask=k_ok[:, None] & pixel_ok[None, :], other=0.0)
    m_begin = tl.program_id(1) * (BLOCK_M * M_TILES)
    for m_first in range(m_begin, tl.minimum(m_begin + BLOCK_M * M_TILES, C_OUT), BLOCK_M):
        c_out = m_first + tl.arange(0, BLOCK_M)
        c_out_ok = c_out < C_OUT
        w_offsets, _ = weight_offsets(c_out[:, None], k[None, :], C_IN, C_OUT, W_TRANSPOSED)
        w_tile = tl.load(w + w_offsets, mask=c_out_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w_tile, x_tile, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias + c_out, mask=c_out_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y + (b.to(tl.int64) * C_OUT + c_out[:, None]) * HW + pixel[None, :], acc.to(y.dtype.element_ty),
                 mask=c_out_ok[:, None] & pixel_ok[None, :])


@triton.jit
def pointwise_tf32_product(
    x, w, bias, y, B, C_IN, C_OUT, HW,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    M_TILES: tl.constexpr, W_TRANSPOSED: tl.constexpr,
):
    """The body of `conv2d_pointwise` for fp32 x with TF32, in either tiling: the same sums transposed,
    y[b]^T = x[b]^T @ w^T, so that the x tile ([BLOCK_N pixels, BLOCK_K], pixels contiguous), rounded by
    `tf32_rounded`, is the product's register operand and the w^T tile the K-major one, which the tensor
    cores read from shared memory and truncate to TF32 (rounding it too sends it through registers and
    back, which cost more time than the accuracy it bought; docs/notes.md, "fp32 on tensor cores: tf32x3,
    bf16x3, rounding")."""
    b, pixel, pixel_ok = image_pixel_tile(HW, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_tile_ptr = x + b.to(tl.int64) * C_IN * HW + k[None, :].to(tl.int64) * HW + pixel[:, None]
    if M_TILES == 0:
        m_begin = tl.program_id(1) * BLOCK_M
        m_end = m_begin + 1
    else:
        m_begin = tl.program_id(1) * (BLOCK_M * M_TILES)
        m_end = tl.minimum(m_begin + BLOCK_M * M_TILES, C_OUT)
        x_tile = tf32_rounded(tl.load(x_tile_ptr, mask=pixel_ok[:, None] & (k < C_IN)[None, :], other=0.0))
    for m_first in range(m_begin, m_end, BLOCK_M):
        c_out = m_first + tl.arange(0, BLOCK_M)
        c_out_ok = c_out < C_OUT
        w_offsets, k_step = weight_offsets(c_out[None, :], k[:, None], C_IN, C_OUT, W_TRANSPOSED)
        w_tile_ptr = w + w_offsets
        if M_TILES == 0:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k_first in range(0, C_IN, BLOCK_K):
                k_ok = (k_first + k) < C_IN
                x_slice = tf32_rounded(tl.load(x_tile_ptr + k_first * HW, mask=pixel_ok[:, None] & k_ok[None, :],
                                               other=0.0))
                w_tile = tl.load(w_tile_ptr + k_first * k_step, mask=k_ok[:, None] & c_out_ok[None, :], other=0.0)
                acc = tl.dot(x_slice, w_tile, acc, input_precision="tf32")
        else:
            w_tile = tl.load(w_tile_ptr, mask=(k < C_IN)[:, None] & c_out_ok[None, :], other=0.0)
            acc = tl.dot(x_tile, w_tile, input_precision="tf32")
        if HAS_BIAS:
            acc += tl.load(bias + c_out, mask=c_out_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y + (b.to(tl.int64) * C_OUT + c_out[None, :]) * HW + pixel[:, None], acc.to(y.dtype.element_ty),
                 mask=pixel_ok[:, None] & c_out_ok[None, :])


@triton.jit
def conv2d_pointwise(
    x, w, bias, y, B, C_IN, C_OUT, HW,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr, W_TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_TILES: tl.constexpr,
):
    """1x1 convolution, stride 1, no padding, one group: y[b] = w @ x[b] (+ bias).

    Grid: (B * cdiv(HW, BLOCK_N), cdiv(C_OUT, BLOCK_M * T)), T = max(1, M_TILES); the batch shares axis 0
    with the pixel tiles because axes 1 and 2 stop at 65535. Program (b * cdiv(HW, BLOCK_N) + pn, pm)
    writes y[b, c_out, p] for the BLOCK_N pixels p of tile pn and the channels c_out of the T tiles of
    BLOCK_M from pm*T on:
        y[b, c_out, p] = bias[c_out] + sum over c_in of w[c_out, c_in] * x[b, c_in, p].
    M_TILES = 0: one channel tile, the sum over C_IN in BLOCK_K slices. M_TILES > 0 (C_IN <= BLOCK_K): the
    x tile holds the whole sum and is loaded once for the T tiles, not once per tile (dx of a 1x1 layer,
    whose reduction is its C_OUT; docs/notes.md, "Convolution: implicit-GEMM tiling").
    Sums accumulated in fp32, y rounded once; fp32 with TF32 in TF32 products (`pointwise_tf32_product`: x
    rounded to nearest, w truncated), fp32 otherwise in FMA products, not `conv_dot`'s tf32x3, which is
    slower here because the x tile runs along pixels, not K (docs/notes.md, "fp32 on tensor cores: tf32x3,
    bf16x3, rounding"). Every element of y is written; bias is read only when HAS_BIAS.
    With W_TRANSPOSED, w[c_out, c_in] is read at w + c_in * C_OUT + c_out: called so with the forward's own
    weight ([C_OUT, C_IN] of the forward) and dy for x, it computes dx.
    """
    if TF32 and x.dtype.element_ty == tl.float32:
        pointwise_tf32_product(x, w, bias, y, B, C_IN, C_OUT, HW, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, M_TILES,
                               W_TRANSPOSED)
    elif M_TILES == 0:
        pointwise_product(x, w, bias, y, B, C_IN, C_OUT, HW, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, W_TRANSPOSED)
    else:
        pointwise_whole_k_product(x, w, bias, y, B, C_IN, C_OUT, HW, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, M_TILES,
                                  W_TRANSPOSED)


@triton.jit
def conv2d_pointwise_fp32_out(
    x, w, y, B, C_IN, C_OUT, HW,
    TF32: tl.constexpr, W_TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_TILES: tl.constexpr,
):
    """`conv2d_pointwise` without bias, y in fp32 whatever x's type: y[b] = w @ x[b], not rounded to x's type.

    Grid, programs and products as conv2d_pointwise's. nnkernels.conv2d's dx of a convolution with few
    input channels runs it on dy with the weight as [C_OUT, C_IN*KH*KW], W_TRANSPOSED, for the columns that
    `Fold2d` sums, so that dx is rounded once. The stem's reduction (its 64 output channels) fits one x
    tile, so M_TILES > 0 suits it (docs/notes.md, "Convolution: implicit-GEMM tiling").
    """
    conv2d_pointwise(x, w, y, y, B, C_IN, C_OUT, HW, False, TF32, W_TRANSPOSED, BLOCK_M, BLOCK_N, BLOCK_K, M_TILES)


Conv2dPointwise = kernel_object(
    conv2d_pointwise,
    helpers=(image_pixel_tile, weight_offsets, pointwise_product, pointwise_whole_k_product, pointwise_tf32_product,
             tf32_rounded),
    example=(False, True, False, 64, 128, 32, 0),
    entry=conv2d_pointwise_entry,
    nonnegative=("M_TILES",),
    flags=("HAS_BIAS", "TF32", "W_TRANSPOSED"),
)
Conv2dPointwiseFp32Out = kernel_object(
    conv2d_pointwise_fp32_out,
    helpers=(conv2d_pointwise, image_pixel_tile, weight_offsets, pointwise_product, pointwise_whole_k_product,
             pointwise_tf32_product, tf32_rounded),
    example=(True, True, 64, 128, 64, 3),
    entry=conv2d_pointwise_fp32_out_entry,
    nonnegative=("M_TILES",),
    pointer_dtypes={"y": torch.float32},
    flags=("TF32", "W_TRANSPOSED"),
)


def conv2d_pointwise_dw_entry(k, a):
    """Grid (cdiv(C_OUT, block_m) * (cdiv(C_IN, block_n) + has_bias), SPLIT) for `Conv2dPointwiseDw`."""
    check_numel("dy", a.dy, a.B * a.C_OUT * a.HW, "B*C_OUT*HW")
    check_numel("x", a.x, a.B * a.C_IN * a.HW, "B*C_IN*HW")
    steps = a.B * cdiv(a.HW, k.block_k)
    if a.SPLIT > steps:
        raise ValueError(f"SPLIT: expected at most B*cdiv(HW, block_k) = {steps} slices, got {a.SPLIT}")
    row = dw_partial_size(a.C_OUT, a.C_IN, 1, 1, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C_OUT*C_IN [+ C_OUT with HAS_BIAS])")
    m_tiles = cdiv(a.C_OUT, k.block_m)
    return (check_grid(m_tiles * cdiv(a.C_IN, k.block_n) + (m_tiles if k.has_bias else 0))[0], a.SPLIT)


@triton.jit
def conv2d_pointwise_dw(
    dy, x, partial, B, C_IN, C_OUT, HW, SPLIT,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Weight (and bias) gradient of a 1x1, stride-1, unpadded, one-group convolution, split over pixels.

    The reduction runs over steps t = b * cdiv(HW, BLOCK_K) + j (image b, pixels j*BLOCK_K onwards);
    slice s takes steps [s*L, min((s+1)*L, T)), L = cdiv(T, SPLIT), T = B*cdiv(HW, BLOCK_K).
    Grid: (M * cdiv(C_IN, BLOCK_N) + (M when HAS_BIAS), SPLIT), M = cdiv(C_OUT, BLOCK_M). Program (tile, s),
    tile < M * cdiv(C_IN, BLOCK_N), writes
        partial[s, c_out*C_IN + c_in] = sum over its steps' pixels of dy[b, c_out, p] * x[b, c_in, p]
    for its BLOCK_M x BLOCK_N tile; with HAS_BIAS, program (M * cdiv(C_IN, BLOCK_N) + m, s) writes
        partial[s, C_OUT*C_IN + c_out] = sum over the same pixels of dy[b, c_out, p]
    for the BLOCK_M channels of tile m. The sums have programs of their own because a product operand
    summed in registers too gets a racing pipeline (`ops.common.tensor_core.sums_beside_dot`).
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 sums; every element of `partial` is
    written. Conv2dDwReduce then adds the slices in order (deterministic).
    """
    pid_tile = tl.program_id(0)
    split = tl.program_id(1)
    num_n_tiles = tl.cdiv(C_IN, BLOCK_N)
    product_tiles = tl.cdiv(C_OUT, BLOCK_M) * num_n_tiles
    steps_per_image = tl.cdiv(HW, BLOCK_K)
    steps = B * steps_per_image
    per_slice = tl.cdiv(steps, SPLIT)
    first = split * per_slice
    end = tl.minimum(first + per_slice, steps)
    p = tl.arange(0, BLOCK_K)
    row = partial_row(partial, split, C_OUT * C_IN, C_OUT, HAS_BIAS)
    if pid_tile < product_tiles:
        c_out = (pid_tile // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        c_in = (pid_tile % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_out_ok = c_out < C_OUT
        c_in_ok = c_in < C_IN
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in range(first, end):
            b = step // steps_per_image
            pixel = (step % steps_per_image) * BLOCK_K + p
            pixel_ok = pixel < HW
            dy_tile = tl.load(dy + (b.to(tl.int64) * C_OUT + c_out[:, None]) * HW + pixel[None, :],
                              mask=c_out_ok[:, None] & pixel_ok[None, :], other=0.0)
            x_tile = tl.load(x + (b.to(tl.int64) * C_IN + c_in[None, :]) * HW + pixel[:, None],
                             mask=pixel_ok[:, None] & c_in_ok[None, :], other=0.0)
            acc = conv_dot(dy_tile, x_tile, acc, TF32)
        tl.store(row + c_out[:, None] * C_IN + c_in[None, :], acc, mask=c_out_ok[:, None] & c_in_ok[None, :])
    elif HAS_BIAS:
        c_out = (pid_tile - product_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        c_out_ok = c_out < C_OUT
        dbias = tl.zeros([BLOCK_M], dtype=tl.float32)
        for step in range(first, end):
            pixel = (step % steps_per_image) * BLOCK_K + p
            dy_tile = tl.load(dy + ((step // steps_per_image).to(tl.int64) * C_OUT + c_out[:, None]) * HW
                              + pixel[None, :], mask=c_out_ok[:, None] & (pixel < HW)[None, :], other=0.0)
            dbias += tl.sum(dy_tile.to(tl.float32), axis=1)
        tl.store(row + C_OUT * C_IN + c_out, dbias, mask=c_out_ok)


Conv2dPointwiseDw = kernel_object(
    conv2d_pointwise_dw,
    helpers=(conv_dot, *PARTIAL_ROW_HELPERS),
    example=(False, True, 64, 64, 64),
    entry=conv2d_pointwise_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    flags=("HAS_BIAS", "TF32"),
)
