"""Convolution data gradient of a strided layer from tiles the tensor memory accelerator copies: `Conv2dTmaDx`.

`Conv2dGemmClDx` computes a pointer and a mask per pixel of its dy tiles. Its programs take the dx pixels of
one stride phase, whose dy pixels for a tap lie one dy pixel apart, so a pixel tile taken as a box of the phase
grid, [BOX_B images, BOX_H rows, BOX_W columns], meets dy in one box shifted by the tap: one box of a 4-D
tensor descriptor, copied by the TMA, whose zero fill outside dy is exactly the taps that reach past its edge.
The weight tile is a box of a 2-D descriptor. It and the strided TMA dw replace the pointer kernels on strided
channels-last layers, whose backward those left far behind cuDNN's (docs/notes.md, "TMA"). Stride-1 layers run
their dx as a forward.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ...launcher import use_torch_scratch
from .channels_last_dx import stride_phase
from .checks import check_conv_launch
from .gemm_dx import phase_taps
from ..common.checks import check_grid_3d, check_numel
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot
from ..common.tma import check_box_sides, check_tma_rows


def conv2d_tma_dx_entry(k, a):
    """Grid (cdiv(B, BOX_B) * boxes per phase plane, c_in tiles, STRIDE_H * STRIDE_W) for `Conv2dTmaDx`."""
    check_box_sides(k, "box_b", "box_h", "box_w")
    check_conv_launch(k, a, 1, weight=False)
    check_tma_rows("C_OUT", a.C_OUT, a.dy)
    check_tma_rows("C_OUT", a.C_OUT, a.w_t)
    if a.C_OUT % k.block_k:
        raise ValueError(f"C_OUT: expected a multiple of block_k = {k.block_k}, got {a.C_OUT}")
    check_numel("w_t", a.w_t, k.kh * k.kw * a.C_IN * a.C_OUT, "KH*KW*C_IN*C_OUT")
    use_torch_scratch()
    rows, cols = cdiv(a.H, k.stride_h), cdiv(a.W, k.stride_w)
    return check_grid_3d(cdiv(a.B, k.box_b) * cdiv(rows, k.box_h) * cdiv(cols, k.box_w), cdiv(a.C_IN, k.block_n),
                         k.stride_h * k.stride_w)


@triton.jit
def conv2d_tma_dx(
    dy, w_t, dx, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, TF32: tl.constexpr,
    BOX_B: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """2-D convolution data gradient (groups = 1, any stride) from channels-last dy into channels-last dx; TMA
    boxes, gather form, no atomics.

    dy is [B, OH, OW, C_OUT] and w_t the weight as [KH, KW, C_IN, C_OUT], contiguous, with rows of 16-byte
    multiples on 16-byte aligned bases, C_OUT % BLOCK_K == 0; dx is [B, H, W, C_IN], contiguous. A phase
    (ph, pw) of dx holds the pixels (ph + i*STRIDE_H, pw + j*STRIDE_W), i < PR = cdiv(H, STRIDE_H), j < PC =
    cdiv(W, STRIDE_W); a pixel tile is a box of BLOCK_M = BOX_B*BOX_H*BOX_W of them (b, i, j), NB =
    cdiv(B, BOX_B) * cdiv(PR, BOX_H) * cdiv(PC, BOX_W) per phase, box n = (g*cdiv(PR, BOX_H) + bh)*cdiv(PC,
    BOX_W) + bw.
    Grid: (NB, cdiv(C_IN, BLOCK_N), STRIDE_H*STRIDE_W). Program (n, pn, ph*STRIDE_W + pw) writes, for the box's
    pixels that lie in dx and the BLOCK_N channels c_in of tile pn,
        dx[b, ih, iw, c_in] = sum over (kh, kw, c_out) of dy[b, oh, ow, c_out] * w_t[kh, kw, c_in, c_out],
        oh = (ih + PAD_H - kh*DIL_H) / STRIDE_H, ow = (iw + PAD_W - kw*DIL_W) / STRIDE_W,
    over the taps where both divisions are exact (`phase_taps`: one arithmetic progression per axis), dy read as
    0 outside the tensor (the TMA's fill); K runs over (tap pairs, c_out) in BLOCK_K slices, each inside one tap.
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 accumulation, dx rounded once; every element
    of dx is written (0 where no tap reaches it).
    """
    BLOCK_M: tl.constexpr = BOX_B * BOX_H * BOX_W
    phase = tl.program_id(2)
    phase_h, phase_w, taps_h, taps_w, rows, cols = stride_phase(phase, H, W, KH, KW, STRIDE_H, STRIDE_W, PAD_H, PAD_W,
                                                                DIL_H, DIL_W)
    count_h, first_h, step_h, shift_h, delta_h = taps_h
    count_w, first_w, step_w, shift_w, delta_w = taps_w
    boxes_h = tl.cdiv(rows, BOX_H)
    boxes_w = tl.cdiv(cols, BOX_W)
    pid_box = tl.program_id(0)
    b_first = pid_box // (boxes_h * boxes_w) * BOX_B
    row_first = (pid_box // boxes_w) % boxes_h * BOX_H
    col_first = pid_box % boxes_w * BOX_W
    n_first = tl.program_id(1) * BLOCK_N
    dy_boxes = tl.make_tensor_descriptor(dy, shape=[B, OH, OW, C_OUT], strides=[OH * OW * C_OUT, OW * C_OUT, C_OUT, 1],
                                         block_shape=[BOX_B, BOX_H, BOX_W, BLOCK_K])
    w_tiles = tl.make_tensor_descriptor(w_t, shape=[KH * KW * C_IN, C_OUT], strides=[C_OUT, 1],
                                        block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_first in range(0, count_h * count_w * C_OUT, BLOCK_K):
        tap_pair = k_first // C_OUT
        c_first = k_first - tap_pair * C_OUT
        t_h = tap_pair // count_w
        t_w = tap_pair % count_w
        # Tap t of the progression reads dy row i + shift_h - t*delta_h for phase row i; likewise for columns.
        dy_box = dy_boxes.load([b_first, row_first + shift_h - t_h * delta_h, col_first + shift_w - t_w * delta_w,
                                c_first])
        tap = (first_h + t_h * step_h) * KW + first_w + t_w * step_w
        w_tile = w_tiles.load([tap * C_IN + n_first, c_first])
        acc = conv_dot(tl.reshape(dy_box, [BLOCK_M, BLOCK_K]), tl.trans(w_tile), acc, TF32)
    pixel = tl.arange(0, BLOCK_M)
    b = b_first + pixel // (BOX_H * BOX_W)
    ih = phase_h + (row_first + (pixel // BOX_W) % BOX_H) * STRIDE_H
    iw = phase_w + (col_first + pixel % BOX_W) * STRIDE_W
    c_in = n_first + tl.arange(0, BLOCK_N)
    pixel_first = ((b.to(tl.int64) * H + ih) * W + iw) * C_IN
    ok = ((b < B) & (ih < H) & (iw < W))[:, None] & (c_in < C_IN)[None, :]
    tl.store(dx + pixel_first[:, None] + c_in[None, :], acc.to(dx.dtype.element_ty), mask=ok)


Conv2dTmaDx = kernel_object(
    conv2d_tma_dx,
    helpers=(stride_phase, phase_taps, conv_dot),
    example=(3, 3, 2, 2, 1, 1, 1, 1, False, 1, 8, 8, 64, 64),
    entry=conv2d_tma_dx_entry,
    nonnegative=("PAD_H", "PAD_W"),
    flags=("TF32",),
    num_stages=4,
)
