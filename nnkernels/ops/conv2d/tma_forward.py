"""Convolution forward from tiles the tensor memory accelerator copies: `Conv2dTmaForward`.

`Conv2dGemmClForward` computes a pointer and a mask per pixel of its x tiles. Here a pixel tile is a
box of the output, [BOX_B images, BOX_H rows, BOX_W columns], and its x tile for a tap is the same box
of the channels-last input shifted by the tap: one box of a 4-D tensor descriptor, copied by the TMA,
whose zero fill outside the tensor is the convolution's zero padding (a box starting at row -1 reads
zeros there) and also covers the ragged last boxes. The weight tile is a box of a 2-D descriptor.
It beats the pointer kernel on 14x14 and 7x7 planes; on 28x28 and 56x56 planes the pointer kernel stays
faster in TF32 (docs/notes.md, "TMA").

With a stride s (dividing the planes), x is viewed as [B, H/s, s, W/s, s*C_IN]: input row oh*s + dh is row
oh + floor(dh/s) of phase dh mod s, and likewise for columns, whose phase picks which C_IN-run of the last axis a
box reads. A tap's x tile is then again one box, [BOX_B, BOX_H, 1, BOX_W, BLOCK_K], of a 5-D descriptor, and the
fill outside it is still the padding.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ...launcher import use_torch_scratch
from .channels_last import add_forward_bias, check_forward_k_slices, forward_y_offset, store_forward_tile
from .checks import check_conv_launch
from ..common.checks import check_grid_3d
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot
from ..common.tma import check_box_sides, check_tma_rows


def conv2d_tma_forward_entry(k, a):
    """Grid (cdiv(B, BOX_B) * boxes per image, c_out tiles, SPLIT_K) for `Conv2dTmaForward`."""
    for name, size, stride in (("H", a.H, k.stride_h), ("W", a.W, k.stride_w)):
        if size % stride:
            raise ValueError(f"{name}: expected a multiple of the stride {stride} (x viewed by phases), got {size}")
    check_box_sides(k, "box_b", "box_h", "box_w")
    check_conv_launch(k, a, 1)
    check_tma_rows("C_IN", a.C_IN, a.x)
    check_tma_rows("KH*KW*C_IN", k.kh * k.kw * a.C_IN, a.w)
    check_forward_k_slices(k, a)
    use_torch_scratch()
    return check_grid_3d(cdiv(a.B, k.box_b) * cdiv(a.OH, k.box_h) * cdiv(a.OW, k.box_w),
                         cdiv(a.C_OUT, k.block_n), k.split_k)


@triton.jit
def conv2d_tma_forward(
    x, w, bias, y, partial, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr, FLIP_TAPS: tl.constexpr, Y_NHWC: tl.constexpr,
    BOX_B: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """2-D convolution forward (groups = 1) from channels-last x and w, NCHW y (NHWC when Y_NHWC); TMA boxes.

    x is [B, H, W, C_IN], H and W multiples of STRIDE_H and STRIDE_W, and w is [C_OUT, KH, KW, C_IN],
    contiguous, with rows of 16-byte multiples on 16-byte aligned bases; w's taps in reverse order when FLIP_TAPS
    (w[c_out, KH-1-kh, KW-1-kw, c_in] stands for tap (kh, kw), as in `Conv2dGemmClForward`); C_IN % BLOCK_K == 0.
    A pixel tile is a box of BLOCK_M = BOX_B*BOX_H*BOX_W output pixels (b, oh, ow), NB = cdiv(B, BOX_B) *
    cdiv(OH, BOX_H) * cdiv(OW, BOX_W) of them, box i = (g*cdiv(OH, BOX_H) + bh)*cdiv(OW, BOX_W) + bw.
    Grid: (NB, cdiv(C_OUT, BLOCK_N), SPLIT_K). Program (i, pn, s) takes box i, the BLOCK_N channels
    c_out of tile pn and the K-steps [s*S, min((s+1)*S, KS)) of the KS = KH*KW*C_IN/BLOCK_K slices of K
    (each inside one tap), S = cdiv(KS, SPLIT_K), and forms
        [bias[c_out] in split 0] + sum over those (kh, kw, c_in) of w[c_out, kh, kw, c_in]
            * x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c_in]
    (x read as 0 outside the tensor: the TMA's fill). With SPLIT_K = 1 that is y[b, c_out, oh, ow]
    (NCHW; y[b, oh, ow, c_out] when Y_NHWC); else it goes in fp32 to partial[s] in y's layout and
    `Conv2dDwReduce` (TAPS = 1) adds the splits into y in a fixed order. Pixels of a box outside the output
    are not stored.
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 accumulation, y rounded once; every
    element of y (with SPLIT_K > 1: of `partial`, and y is not touched) is written; bias read only
    when HAS_BIAS, `partial` only when SPLIT_K > 1.
    """
    BLOCK_M: tl.constexpr = BOX_B * BOX_H * BOX_W
    pid_box = tl.program_id(0)
    boxes_h = tl.cdiv(OH, BOX_H)
    boxes_w = tl.cdiv(OW, BOX_W)
    b_first = pid_box // (boxes_h * boxes_w) * BOX_B
    oh_first = (pid_box // boxes_w) % boxes_h * BOX_H
    ow_first = pid_box % boxes_w * BOX_W
    n_first = tl.program_id(1) * BLOCK_N
    taps: tl.constexpr = KH * KW
    k_total = taps * C_IN
    if STRIDE_H * STRIDE_W == 1:
        x_boxes = tl.make_tensor_descriptor(x, shape=[B, H, W, C_IN], strides=[H * W * C_IN, W * C_IN, C_IN, 1],
                                            block_shape=[BOX_B, BOX_H, BOX_W, BLOCK_K])
    else:  # [B, H/s, s, W/s, s*C_IN]: row phase on axis 2, column phase inside the last axis
        x_boxes = tl.make_tensor_descriptor(
            x, shape=[B, H // STRIDE_H, STRIDE_H, W // STRIDE_W, STRIDE_W * C_IN],
            strides=[H * W * C_IN, STRIDE_H * W * C_IN, W * C_IN, STRIDE_W * C_IN, 1],
            block_shape=[BOX_B, BOX_H, 1, BOX_W, BLOCK_K])
    # Offsets that keep a tap's shift kh*DIL_H - PAD_H non-negative, so // and % floor it.
    LIFT_H: tl.constexpr = STRIDE_H * ((PAD_H + STRIDE_H - 1) // STRIDE_H)
    LIFT_W: tl.constexpr = STRIDE_W * ((PAD_W + STRIDE_W - 1) // STRIDE_W)
    w_tiles = tl.make_tensor_descriptor(w, shape=[C_OUT, k_total], strides=[k_total, 1],
                                        block_shape=[BLOCK_N, BLOCK_K])
    steps_per_split = tl.cdiv(k_total // BLOCK_K, SPLIT_K)
    k_begin = tl.program_id(2) * steps_per_split * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_first in range(k_begin, tl.minimum(k_begin + steps_per_split * BLOCK_K, k_total), BLOCK_K):
        tap = k_first // C_IN
        c_first = k_first - tap * C_IN
        if STRIDE_H * STRIDE_W == 1:
            x_box = x_boxes.load([b_first, oh_first + (tap // KW) * DIL_H - PAD_H,
                                  ow_first + (tap % KW) * DIL_W - PAD_W, c_first])
        else:
            shift_h = (tap // KW) * DIL_H - PAD_H + LIFT_H
            shift_w = (tap % KW) * DIL_W - PAD_W + LIFT_W
            x_box = x_boxes.load([b_first, oh_first + shift_h // STRIDE_H - LIFT_H // STRIDE_H, shift_h % STRIDE_H,
                                  ow_first + shift_w // STRIDE_W - LIFT_W // STRIDE_W,
                                  shift_w % STRIDE_W * C_IN + c_first])
        if FLIP_TAPS:
            w_k = (taps - 1 - tap) * C_IN + c_first
        else:
            w_k = k_first
        w_tile = w_tiles.load([n_first, w_k])
        acc = conv_dot(tl.reshape(x_box, [BLOCK_M, BLOCK_K]), tl.trans(w_tile), acc, TF32)
    c_out = n_first + tl.arange(0, BLOCK_N)
    c_out_ok = c_out < C_OUT
    acc = add_forward_bias(acc, bias, c_out, c_out_ok, HAS_BIAS)
    row = tl.arange(0, BLOCK_M)
    b = b_first + row // (BOX_H * BOX_W)
    oh = oh_first + (row // BOX_W) % BOX_H
    ow = ow_first + row % BOX_W
    ohw = OH * OW
    y_offset = forward_y_offset(b, oh * OW + ow, c_out, C_OUT, ohw, Y_NHWC)
    y_ok = c_out_ok[:, None] & ((b < B) & (oh < OH) & (ow < OW))[None, :]
    store_forward_tile(acc, y, partial, y_offset, y_ok, B, C_OUT, ohw, SPLIT_K)


Conv2dTmaForward = kernel_object(
    conv2d_tma_forward,
    helpers=(conv_dot, add_forward_bias, forward_y_offset, store_forward_tile),
    example=(3, 3, 1, 1, 1, 1, 1, 1, False, True, False, False, 1, 8, 8, 128, 32, 1),
    entry=conv2d_tma_forward_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32", "FLIP_TAPS", "Y_NHWC"),
    num_stages=4,
)
