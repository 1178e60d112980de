"""Convolution data gradient from a channels-last dy, any stride: `Conv2dGemmClDx`.

The gather form of `conv2d_gemm_dx.py` (programs split the pixels of dx by their phase
(ih mod STRIDE_H, iw mod STRIDE_W), so each program's contributing taps are one arithmetic
progression per axis and no term is a multiplication by zero), reading dy channels-last: a
K-slice is BLOCK_K consecutive channels of one dy pixel, 16-byte loads the compiler pipelines,
where the NCHW kernel gathers single elements, which keeps the tensor cores nearly idle
(docs/notes.md, "Convolution: implicit-GEMM tiling").

With a stride, a program's pixels are every STRIDE_W-th of a row: written to NCHW that is two
bytes at every other address (bf16, stride 2), which made the dx most of a strided 3x3 layer's
backward and left it far behind cuDNN's. DX_NHWC writes dx channels-last instead (whole runs of
BLOCK_N channels per pixel); the caller transposes it to NCHW (docs/notes.md, "Convolution: implicit-GEMM tiling").
"""
import math

import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_channel_alignment, check_grid_3d, check_numel
from .channels_last import (check_image_tiles, check_whole_windows, group_window, group_window_width, image_tile,
                            tile_window, window_ok, window_start, window_width)
from .gemm_dx import phase_taps
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot
from ..common.tiles import channel_block, columns_in, known_multiple


def conv2d_gemm_cl_dx_entry(k, a):
    """Grid (cdiv(B, images per tile) * pixel tiles per image and phase, c_in tiles, STRIDE_H * STRIDE_W)
    for `Conv2dGemmClDx`."""
    cin_per_group, cout_per_group = check_conv_launch(k, a, k.g)
    images = check_image_tiles(k)
    check_channel_alignment(k.c_align, math.gcd(cin_per_group, cout_per_group), count="gcd(C_IN/G, C_OUT/G)")
    width = window_width(a.C_OUT, cout_per_group, cin_per_group, k.block_n, k.g)
    check_whole_windows(k, a.C_OUT, cout_per_group, cin_per_group, k.block_n, k.block_k)
    check_numel("w_t", a.w_t, k.kh * k.kw * a.C_IN * width, "KH*KW*C_IN*WIDTH")
    pixels_per_phase = cdiv(a.H, k.stride_h) * cdiv(a.W, k.stride_w)
    return check_grid_3d(cdiv(a.B, images) * cdiv(pixels_per_phase, k.block_q),
                         cdiv(a.C_IN, k.block_n), k.stride_h * k.stride_w)


@triton.jit
def stride_phase(phase, H, W, KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
                 PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr):
    """The stride phase of dx that a gather-form dx program takes from its program index `phase` = ph*STRIDE_W + pw:
    (ph, pw, `phase_taps` of the rows, `phase_taps` of the columns, PR, PC), the phase holding the pixels
    (ph + i*STRIDE_H, pw + j*STRIDE_W) with i < PR = cdiv(H, STRIDE_H) and j < PC = cdiv(W, STRIDE_W)."""
    phase_h = phase // STRIDE_W
    phase_w = phase % STRIDE_W
    taps_h = phase_taps(phase_h, KH, STRIDE_H, PAD_H, DIL_H)
    taps_w = phase_taps(phase_w, KW, STRIDE_W, PAD_W, DIL_W)
    return phase_h, phase_w, taps_h, taps_w, tl.cdiv(H, STRIDE_H), tl.cdiv(W, STRIDE_W)


@triton.jit
def conv2d_gemm_cl_dx(
    dy, w_t, dx, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    G: tl.constexpr, WHOLE_WINDOWS: tl.constexpr, TF32: tl.constexpr, DX_NHWC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr,
    C_ALIGN: tl.constexpr,
):
    """2-D convolution data gradient (G groups) from channels-last dy; gather form, no atomics.

    dy is [B, OH, OW, C_OUT] and w_t is the weight as [KH, KW, C_IN, WIDTH] (both operands
    contiguous along the reduced c_out, as TF32 tensor cores need them), both contiguous; dx is NCHW, or
    [B, H, W, C_IN] when DX_NHWC. A tile's K runs over the WIDTH output channels of the groups of its BLOCK_N
    input channels (`group_window`; G = 1: WIDTH = C_OUT), the last slice of a tap masked unless WHOLE_WINDOWS
    (`whole_windows`: every window whole and aligned; G = 1: BLOCK_K divides C_OUT). G > 1: w_t's rows hold
    those channels' weights, zero outside the row's group (`Conv2dGroupedWeight`, TAPS_OUTER and SRC_TRANSPOSED,
    TILE_N = BLOCK_N): one block-diagonal product for several narrow groups. C_ALIGN as in
    `conv2d_gemm_cl_forward`. One image of dy and one of dx hold fewer than 2**31 elements. A pixel tile is
    I = BLOCK_M/BLOCK_Q images by BLOCK_Q pixels of one phase of each.
    Grid: (cdiv(B, I) * cdiv(PR*PC, BLOCK_Q), cdiv(C_IN, BLOCK_N), STRIDE_H*STRIDE_W), with
    PR = cdiv(H, STRIDE_H) and PC = cdiv(W, STRIDE_W) the rows and columns of a phase. Program
    (g * cdiv(PR*PC, BLOCK_Q) + t, pn, ph*STRIDE_W + pw) writes dx[b, c_in, ih, iw] for the images
    b in [g*I, (g+1)*I), their pixels ih = ph + i*STRIDE_H, iw = pw + j*STRIDE_W with i*PC + j in
    [t*BLOCK_Q, (t+1)*BLOCK_Q) that lie in the image, and the BLOCK_N channels c_in of tile pn:
        dx = sum over (kh, kw, c_out of c_in's group) of dy[b, oh, ow, c_out] * w_t[kh, kw, c_in, c_out - first],
        oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H, ow = (iw + PAD_W - kw*DIL_W) / STRIDE_W,
    over the taps where both divisions are exact and (oh, ow) lies in dy (`phase_taps`); K runs
    over (tap pairs, c_out) in BLOCK_K slices, each inside one tap. Tensor-core products
    (`conv_dot`: fp32 as TF32 or tf32x3), fp32 accumulation, dx rounded once; every element of dx is written (0
    where no tap reaches it).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    phase = tl.program_id(2)
    C_IN = known_multiple(C_IN, C_ALIGN)
    C_OUT = known_multiple(C_OUT, C_ALIGN)
    phase_h, phase_w, taps_h, taps_w, rows, cols = stride_phase(phase, H, W, KH, KW, STRIDE_H, STRIDE_W, PAD_H, PAD_W,
                                                                DIL_H, DIL_W)
    count_h, first_h, step_h, shift_h, delta_h = taps_h
    count_w, first_w, step_w, shift_w, delta_w = taps_w
    b, q = image_tile(pid_m, rows * cols, BLOCK_M, BLOCK_Q)
    row = q // cols
    col = q % cols
    ih = phase_h + row * STRIDE_H
    iw = phase_w + col * STRIDE_W
    pixel_ok = (q < rows * cols) & (ih < H) & (iw < W) & (b < B)
    # Tap t of the progression reads dy row oh_first - t*delta_h; likewise for columns.
    oh_first = row + shift_h
    ow_first = col + shift_w
    dy_image_first = b.to(tl.int64) * OH * OW * C_OUT  # offset of each row's image in dy
    c_in, c_in_ok = channel_block(pid_n, C_IN, BLOCK_N, C_ALIGN)
    channel = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if G == 1 and WHOLE_WINDOWS:
        k_total = count_h * count_w * C_OUT
        for k_first in range(0, k_total, BLOCK_K):
            tap_pair = k_first // C_OUT
            c_first = k_first - tap_pair * C_OUT
            t_h = tap_pair // count_w
            t_w = tap_pair % count_w
            oh = oh_first - t_h * delta_h
            ow = ow_first - t_w * delta_w
            inside = pixel_ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
            dy_tile = tl.load(dy + (dy_image_first + (oh * OW + ow) * C_OUT + c_first)[:, None] + channel[None, :],
                              mask=inside[:, None], other=0.0)
            tap = (first_h + t_h * step_h) * KW + first_w + t_w * step_w
            w_rows = (tap * C_IN + c_in).to(tl.int64) * C_OUT + c_first
            w_tile = tl.trans(tl.load(w_t + w_rows[:, None] + channel[None, :], mask=c_in_ok[:, None], other=0.0))
            acc = conv_dot(dy_tile, w_tile, acc, TF32)
    else:
        cin_per_group = C_IN // G
        cout_per_group = known_multiple(C_OUT // G, C_ALIGN)
        first, end, width, slices = tile_window(pid_n * BLOCK_N, BLOCK_N, cin_per_group, cout_per_group, C_OUT, G,
                                                WHOLE_WINDOWS, BLOCK_K)
        for step in range(0, count_h * count_w * slices):
            tap_pair = step // slices
            c_out = first + (step % slices) * BLOCK_K + channel
            c_out_ok = window_ok(c_out, end, BLOCK_K, WHOLE_WINDOWS, C_ALIGN)
            t_h = tap_pair // count_w
            t_w = tap_pair % count_w
            oh = oh_first - t_h * delta_h
            ow = ow_first - t_w * delta_w
            inside = pixel_ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
            dy_tile = tl.load(dy + (dy_image_first + (oh * OW + ow) * C_OUT)[:, None] + c_out[None, :],
                              mask=inside[:, None] & c_out_ok[None, :], other=0.0)
            tap = (first_h + t_h * step_h) * KW + first_w + t_w * step_w
            w_rows = (tap * C_IN + c_in).to(tl.int64) * width
            w_tile = tl.trans(tl.load(w_t + w_rows[:, None] + (c_out - first)[None, :],
                                      mask=c_in_ok[:, None] & c_out_ok[None, :], other=0.0))
            acc = conv_dot(dy_tile, w_tile, acc, TF32)
    if DX_NHWC:
        pixel_first = ((b.to(tl.int64) * H + ih) * W + iw) * C_IN
        tl.store(dx + pixel_first[:, None] + c_in[None, :], acc.to(dx.dtype.element_ty),
                 mask=pixel_ok[:, None] & c_in_ok[None, :])
    else:
        if STRIDE_H * STRIDE_W == 1:
            pixel_offset = q  # ih*W + iw, written so the compiler sees the pixels are consecutive
        else:
            pixel_offset = ih * W + iw
        tl.store(
            dx + (c_in.to(tl.int64) * H * W)[:, None] + (b.to(tl.int64) * C_IN * H * W + pixel_offset)[None, :],
            tl.trans(acc).to(dx.dtype.element_ty),
            mask=c_in_ok[:, None] & pixel_ok[None, :],
        )


Conv2dGemmClDx = kernel_object(
    conv2d_gemm_cl_dx,
    helpers=(stride_phase, phase_taps, conv_dot, image_tile, group_window, window_start, window_ok, group_window_width,
             tile_window, channel_block, columns_in, known_multiple),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, True, True, False, 128, 64, 64, 128, 1),
    entry=conv2d_gemm_cl_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("WHOLE_WINDOWS", "TF32", "DX_NHWC"),
)
