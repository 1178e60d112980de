"""2-D convolution data gradient as an implicit GEMM on tensor cores, without atomics: `Conv2dGemmDx`.

Gather form: each program owns a tile of dx and sums into it every (c_out, kh, kw) term that
reaches it, so no two programs write the same element. With stride s an input row ih is reached
by tap kh only when (ih + PAD_H - kh*DIL_H) is a multiple of s, and which taps those are depends
only on ih mod s. So the programs split the pixels by their phase (ih mod s, iw mod s): within a
program the contributing taps are the same for every pixel, and the K loop runs over those taps
only (one loop over taps x channels, so it pipelines), instead of multiplying by zero.
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from .checks import check_conv_launch
from .gemm_forward import store_nchw_transposed
from ..common.checks import check_grid_3d
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot


def conv2d_gemm_dx_entry(k, a):
    """Grid (pixel tiles of one phase, c_in tiles, G * STRIDE_H * STRIDE_W) for `Conv2dGemmDx`."""
    cin_per_group, _ = check_conv_launch(k, a, k.g)
    pixels_per_phase = a.B * cdiv(a.H, k.stride_h) * cdiv(a.W, k.stride_w)
    return check_grid_3d(
        cdiv(pixels_per_phase, k.block_m), cdiv(cin_per_group, k.block_n), k.g * k.stride_h * k.stride_w
    )


@triton.jit
def phase_taps(phase, K: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr):
    """The taps of one axis that reach the dx pixels of one phase, for the gather-form dx kernels.

    Pixel i of `phase` (input index phase + i*STRIDE) is reached by tap k iff
    k*DIL = phase + PAD (mod STRIDE): `count` taps first + t*step (t < count), an arithmetic
    progression; tap t reads dy at index i + shift - t*delta (exact divisions). Returns
    (count, first, step, shift, delta); with count 0 the others are unused.
    """
    count = phase * 0
    first = phase * 0
    second = phase * 0
    for k in tl.static_range(K):
        hit = (phase + PAD - k * DIL) % STRIDE == 0
        first = tl.where(hit & (count == 0), k, first)
        second = tl.where(hit & (count == 1), k, second)
        count += hit.to(tl.int32)
    step = tl.maximum(second - first, 1)
    return count, first, step, (phase + PAD - first * DIL) // STRIDE, step * DIL // STRIDE


@triton.jit
def conv2d_gemm_dx(
    dy, w, dx, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, G: tl.constexpr,
    TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """2-D convolution data gradient, implicit GEMM with tl.dot, gather form (no atomics).

    Grid: (cdiv(B*cdiv(H,STRIDE_H)*cdiv(W,STRIDE_W), BLOCK_M), cdiv(C_IN/G, BLOCK_N), G*STRIDE_H*STRIDE_W).
    Program (pm, pn, (g*STRIDE_H + ph)*STRIDE_W + pw) writes dx[b, c_in, ih, iw] for the BLOCK_M pixels
    ih = ph + i*STRIDE_H, iw = pw + j*STRIDE_W (p = (b*cdiv(H,STRIDE_H) + i)*cdiv(W,STRIDE_W) + j) of
    tile pm that lie in the image, and the BLOCK_N channels c_in = g*(C_IN/G) + n of tile pn:
        dx = sum over (c_out_local, kh, kw) of dy[b, g*(C_OUT/G) + c_out_local, oh, ow] * w[c_out, n, kh, kw],
        oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H, ow = (iw + PAD_W - kw*DIL_W) / STRIDE_W,
    over the taps where both divisions are exact and (oh, ow) lies in dy. Those taps are, per axis,
    an arithmetic progression (first, first + step, ...); K runs over (tap pairs, c_out_local) in
    BLOCK_K slices. Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 accumulation, dx rounded
    once; every element of dx is written (0 where no tap reaches it).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    group = pid_z // (STRIDE_H * STRIDE_W)
    phase_h = (pid_z // STRIDE_W) % STRIDE_H
    phase_w = pid_z % STRIDE_W
    cin_per_group = C_IN // G
    cout_per_group = C_OUT // G
    taps: tl.constexpr = KH * KW
    count_h, first_h, step_h, shift_h, delta_h = phase_taps(phase_h, KH, STRIDE_H, PAD_H, DIL_H)
    count_w, first_w, step_w, shift_w, delta_w = phase_taps(phase_w, KW, STRIDE_W, PAD_W, DIL_W)
    rows_per_phase = tl.cdiv(H, STRIDE_H)
    cols_per_phase = tl.cdiv(W, STRIDE_W)
    pixels_per_image = rows_per_phase * cols_per_phase
    pixel = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    b = pixel // pixels_per_image
    row = (pixel % pixels_per_image) // cols_per_phase
    col = pixel % cols_per_phase
    ih = phase_h + row * STRIDE_H
    iw = phase_w + col * STRIDE_W
    pixel_ok = (pixel < B * pixels_per_image) & (ih < H) & (iw < W)
    ohw = OH * OW
    oh_first = row + shift_h
    ow_first = col + shift_w
    oh_low = oh_first - OH
    ow_low = ow_first - OW
    # dy offset of (b, first channel of the group, oh_first, ow_first); masked where outside dy.
    dy_pixel = (b.to(tl.int64) * C_OUT + group * cout_per_group) * ohw + oh_first * OW + ow_first
    c_in = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_in_ok = c_in < cin_per_group
    w_column = c_in * taps
    k_total = count_h * count_w * cout_per_group
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_first in range(0, k_total, BLOCK_K):
        k = k_first + tl.arange(0, BLOCK_K)
        k_ok = k < k_total
        c_out = k % cout_per_group
        tap_pair = k // cout_per_group
        t_h = tap_pair // count_w
        t_w = tap_pair % count_w
        back_h = t_h * delta_h
        back_w = t_w * delta_w
        # oh = oh_first - back_h lies in [0, OH) iff oh_first - OH < back_h <= oh_first: row-column compares.
        inside = (back_h[:, None] <= oh_first[None, :]) & (back_h[:, None] > oh_low[None, :])
        inside &= (back_w[:, None] <= ow_first[None, :]) & (back_w[:, None] > ow_low[None, :])
        inside &= k_ok[:, None] & pixel_ok[None, :]
        dy_k = c_out * ohw - back_h * OW - back_w
        # [K, pixels]: the pixel axis, contiguous in NCHW, is the fastest one.
        dy_tile = tl.load(dy + dy_pixel[None, :] + dy_k[:, None], mask=inside, other=0.0)
        w_k = (group * cout_per_group + c_out) * (cin_per_group * taps) + (first_h + t_h * step_h) * KW \
            + first_w + t_w * step_w
        w_tile = tl.load(w + w_k[:, None] + w_column[None, :], mask=k_ok[:, None] & c_in_ok[None, :], other=0.0)
        acc = conv_dot(tl.trans(dy_tile), w_tile, acc, TF32)
    dx_pixel = b.to(tl.int64) * C_IN * H * W + ih * W + iw
    dx_channel = (group * cin_per_group + c_in).to(tl.int64) * H * W
    store_nchw_transposed(dx, dx_channel, dx_pixel, acc, c_in_ok, pixel_ok)


Conv2dGemmDx = kernel_object(
    conv2d_gemm_dx,
    helpers=(phase_taps, conv_dot, store_nchw_transposed),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, True, 128, 64, 32),
    entry=conv2d_gemm_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("TF32",),
)
