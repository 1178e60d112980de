"""Convolution weight gradient from tiles the tensor memory accelerator copies: `Conv2dTmaDw`.

The channels-last dw kernel (`Conv2dGemmClDw`) computes a pointer and a mask per element of its
tiles, and that address arithmetic left it several times slower than cuDNN's weight gradient
(docs/notes.md, "TMA"). Here every tile is one box of a 4-D tensor descriptor,
[1 image, BOX_H rows, BOX_W columns, channels], copied by the TMA unit: no per-element address
arithmetic, and the copy itself fills with zeros whatever lies outside the tensor, which for x
is exactly the convolution's zero padding (a box starting at row -1 reads zeros there) and for
dy the ragged edge of the last box. So no masks either. A strided layer's x boxes are boxes of a strided
view of x (a descriptor whose row and column strides are STRIDE_H rows and STRIDE_W pixels), one per tap.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ...launcher import use_torch_scratch
from ..common.checks import check_grid_3d, check_numel
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tensor_core import BF16X3_HELPERS, bf16x3_dot, bf16x3_total, conv_dot
from ..common.tiles import zero_tiles
from ..common.tma import check_box_sides, check_tma_rows


def conv2d_tma_dw_entry(k, a):
    """Grid (c_out tiles * tap groups * c_in tiles, SPLIT, 1) for `Conv2dTmaDw`."""
    check_box_sides(k, "box_h", "box_w")
    check_conv_launch(k, a, 1)
    if k.kw % k.row_taps:
        raise ValueError(f"row_taps: expected a divisor of KW = {k.kw}, got {k.row_taps}")
    check_tma_rows("C_IN", a.C_IN, a.x)
    check_tma_rows("C_OUT", a.C_OUT, a.dy)
    boxes = a.B * cdiv(a.OH, k.box_h) * cdiv(a.OW, k.box_w)
    if a.SPLIT > boxes:
        raise ValueError(f"SPLIT: expected at most B*cdiv(OH, BOX_H)*cdiv(OW, BOX_W) = {boxes} slices, got {a.SPLIT}")
    row = dw_partial_size(a.C_OUT, a.C_IN, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C_OUT*C_IN*KH*KW [+ C_OUT with HAS_BIAS])")
    use_torch_scratch()
    tiles = cdiv(a.C_OUT, k.block_m) * (k.kh * k.kw // k.row_taps) * cdiv(a.C_IN, k.block_n)
    return check_grid_3d(tiles, a.SPLIT, 1)


@triton.jit
def _tap_window(shift, out_size, in_size, STRIDE: tl.constexpr, BOX: tl.constexpr):
    """(first, count): the output positions o in [first, first + count) whose input o*STRIDE + shift lies
    in [0, in_size). A tap that meets only padding gets a window past every box (first = out_size + BOX,
    count = 1), so its loads are all fill: a descriptor needs a size of at least 1."""
    if STRIDE == 1:
        first = tl.maximum(0, -shift)
        count = tl.minimum(out_size, in_size - shift) - first
    else:
        first = tl.maximum(0, (STRIDE - 1 - shift) // STRIDE)  # ceil(-shift / STRIDE) where shift < 0
        inside = in_size > shift  # some o*STRIDE + shift < in_size with o >= 0
        count = tl.minimum(out_size, tl.where(inside, (in_size - 1 - shift) // STRIDE + 1, 0)) - first
    empty = count <= 0
    return tl.where(empty, out_size + BOX, first), tl.where(empty, 1, count)


@triton.jit
def conv2d_tma_dw(
    dy, x, partial, B, C_IN, C_OUT, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, TF32: tl.constexpr, ROW_TAPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr,
):
    """2-D convolution weight gradient (groups = 1) from channels-last dy and x, split over pixels.

    dy is [B, OH, OW, C_OUT] and x is [B, H, W, C_IN], contiguous, with rows of 16-byte multiples
    (C * element size) on 16-byte aligned bases. The pixels run in boxes of BOX_H x BOX_W of one
    image, NB = B * cdiv(OH, BOX_H) * cdiv(OW, BOX_W) of them, box i = (b*cdiv(OH, BOX_H) + bh) *
    cdiv(OW, BOX_W) + bw. A program takes ROW_TAPS taps of one kernel row (kh, kw0 .. kw0+ROW_TAPS-1),
    BLOCK_M channels c_out and BLOCK_N channels c_in, and loads each dy box once for its taps.
    Grid: (cdiv(C_OUT, BLOCK_M) * (KH*KW/ROW_TAPS) * cdiv(C_IN, BLOCK_N), SPLIT, 1). Program (tile, s)
    takes the boxes [s*L, min((s+1)*L, NB)) with L = cdiv(NB, SPLIT) and writes, for its taps
    tap = kh*KW + kw, tap-major (`Conv2dDwReduce` with TAPS = KH*KW puts them in dw's order),
        partial[s, tap*C_OUT*C_IN + c_out*C_IN + c_in] = sum over the boxes' pixels (b, oh, ow) of
            dy[b, oh, ow, c_out] * x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c_in]
    with both read as 0 outside their tensors (the TMA's fill), and when HAS_BIAS the programs of
    the first taps and c_in tile also write partial[s, C_OUT*C_IN*KH*KW + c_out] = the sum of dy.
    Tensor-core products, fp32 sums: fp32 as `bf16x3_dot` when TF32 (channels-last tiles run along
    channels, not the reduced pixels, which TF32 tensor cores cannot read as they are), as tf32x3
    (`conv_dot`) otherwise; every element of `partial` is written.
    """
    pid_tile = tl.program_id(0)
    split = tl.program_id(1)
    taps: tl.constexpr = KH * KW
    BOX: tl.constexpr = BOX_H * BOX_W
    c_in_tiles = tl.cdiv(C_IN, BLOCK_N)
    tap_groups: tl.constexpr = taps // ROW_TAPS
    tile_m = pid_tile // (tap_groups * c_in_tiles)
    tap_group = (pid_tile // c_in_tiles) % tap_groups
    tile_n = pid_tile % c_in_tiles
    tap_first = tap_group * ROW_TAPS  # kh*KW + kw0: the group's taps share kh
    kh = tap_first // KW
    kw_first = tap_first % KW
    c_out_first = tile_m * BLOCK_M
    c_in_first = tile_n * BLOCK_N
    dy_boxes = tl.make_tensor_descriptor(dy, shape=[B, OH, OW, C_OUT], strides=[OH * OW * C_OUT, OW * C_OUT, C_OUT, 1],
                                         block_shape=[1, BOX_H, BOX_W, BLOCK_M])
    # Tap (kh, kw) pairs dy pixel (oh, ow) with x pixel (oh*STRIDE_H + dh, ow*STRIDE_W + dw). Its x
    # descriptor, over every STRIDE_H-th row and STRIDE_W-th column, starts at dy pixel (row_first,
    # col_first), the first whose x pixel lies in the image, and ends where dy or x does: the TMA's zero
    # fill then covers the padding and dy's ragged last boxes alike, so no x value is ever paired with a
    # dy outside the output (a NaN there would otherwise reach dw as 0 * NaN).
    dh = kh * DIL_H - PAD_H
    row_first, rows = _tap_window(dh, OH, H, STRIDE_H, BOX_H)
    x_boxes = ()
    col_firsts = ()
    for t in tl.static_range(ROW_TAPS):
        dw = (kw_first + t) * DIL_W - PAD_W
        col_first, cols = _tap_window(dw, OW, W, STRIDE_W, BOX_W)
        x_first = x + ((row_first * STRIDE_H + dh) * W + col_first * STRIDE_W + dw).to(tl.int64) * C_IN
        x_boxes = x_boxes + (tl.make_tensor_descriptor(x_first, shape=[B, rows, cols, C_IN],
                                                       strides=[H * W * C_IN, STRIDE_H * W * C_IN,
                                                                STRIDE_W * C_IN, 1],
                                                       block_shape=[1, BOX_H, BOX_W, BLOCK_N]),)
        col_firsts = col_firsts + (col_first,)
    boxes_h = tl.cdiv(OH, BOX_H)
    boxes_w = tl.cdiv(OW, BOX_W)
    boxes = B * boxes_h * boxes_w
    slice_len = tl.cdiv(boxes, SPLIT)
    acc = zero_tiles(ROW_TAPS, BLOCK_M, BLOCK_N)
    cross = zero_tiles(ROW_TAPS, BLOCK_M, BLOCK_N)  # bf16x3's low-part products (fp32, TF32)
    dbias = tl.zeros([BLOCK_M], dtype=tl.float32)
    for box in range(split * slice_len, tl.minimum((split + 1) * slice_len, boxes)):
        b = box // (boxes_h * boxes_w)
        oh = (box // boxes_w) % boxes_h * BOX_H
        ow = box % boxes_w * BOX_W
        dy_tile = tl.reshape(dy_boxes.load([b, oh, ow, c_out_first]), [BOX, BLOCK_M])
        updated = ()
        updated_cross = ()
        for t in tl.static_range(ROW_TAPS):
            x_box = x_boxes[t].load([b, oh - row_first, ow - col_firsts[t], c_in_first])
            dy_t, x_t = tl.trans(dy_tile), tl.reshape(x_box, [BOX, BLOCK_N])
            if TF32:
                acc_t, cross_t = bf16x3_dot(dy_t, x_t, acc[t], cross[t])
            else:
                acc_t, cross_t = conv_dot(dy_t, x_t, acc[t], False), cross[t]
            updated = updated + (acc_t,)
            updated_cross = updated_cross + (cross_t,)
        acc = updated
        cross = updated_cross
        if HAS_BIAS:
            dbias += tl.sum(dy_tile.to(tl.float32), axis=0)
    row = partial_row(partial, split, C_OUT * C_IN * taps, C_OUT, HAS_BIAS)
    c_out = c_out_first + tl.arange(0, BLOCK_M)
    c_in = c_in_first + tl.arange(0, BLOCK_N)
    ok = (c_out < C_OUT)[:, None] & (c_in < C_IN)[None, :]
    for t in tl.static_range(ROW_TAPS):  # tap-major: runs of BLOCK_N floats (dw's own order scatters them)
        plane = row + (tap_first + t) * (C_OUT * C_IN)
        total = acc[t]
        if TF32:
            total = bf16x3_total(acc[t], cross[t], x.dtype.element_ty)
        tl.store(plane + (c_out * C_IN)[:, None] + c_in[None, :], total, mask=ok)
    if HAS_BIAS:
        if (tap_first == 0) & (tile_n == 0):
            tl.store(row + C_OUT * C_IN * taps + c_out, dbias, mask=c_out < C_OUT)


Conv2dTmaDw = kernel_object(
    conv2d_tma_dw,
    helpers=(_tap_window, zero_tiles, conv_dot, *BF16X3_HELPERS, *PARTIAL_ROW_HELPERS),
    example=(3, 3, 1, 1, 1, 1, 1, 1, False, False, 3, 64, 64, 8, 8),
    entry=conv2d_tma_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("HAS_BIAS", "TF32"),
)
