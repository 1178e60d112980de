"""A convolution's input taps laid out as planes, and their adjoint: `Unfold2d` (im2col) and `Fold2d`.

With few input channels (the 3-channel RGB stem) the implicit-GEMM kernels' reduced or output
channel tile is mostly padding, and their dx gathers every tap's dy tile for 3 useful products,
which made the stem's backward slow (docs/notes.md, "Convolution: implicit-GEMM tiling"). Unfolded,
the convolution is a 1x1 product over R = C_IN*KH*KW rows:
    forward:  y[b] = w[C_OUT, R] @ unfold(x)[b]
    dw:       dw[C_OUT, R] = sum over b of dy[b] @ unfold(x)[b]^T
    dx:       dx = fold(w^T @ dy[b]),
where unfold(x)[b, (c, kh, kw), oh, ow] = x[b, c, oh*S_H - P_H + kh*D_H, ow*S_W - P_W + kw*D_W]
(0 outside the image) and fold is its adjoint: each input pixel sums the columns of the taps
that read it. The products run on the 1x1 kernels of conv2d_pointwise.py; dx's columns are fp32,
so the sums round once. nnkernels.conv2d runs the stem's backward this way; its forward stays on the
implicit GEMM, which was faster. Laid out rows-outer ([C*KH*KW, B, OH, OW], with dy as
[C_OUT, B, OH, OW]), dw is one product over all B*OH*OW pixels: nnkernels.conv2d takes that for fp32
weight gradients of small planes such as ResNet-50's 7x7 layers, where it was faster (docs/notes.md,
"fp32 on tensor cores: tf32x3, bf16x3, rounding").
"""
import torch
import triton
import triton.language as tl

from ...kernel import INTERPRETED, kernel_object
from ..common.checks import check_grid_3d, check_numel, check_output_size
from ..common.host_math import cdiv, next_power_of_2

# Elements per program compiled: 2048 per tap (unfold: copies, KW taps of a row) and 1024 (fold: fp32 sums
# of up to KH*KW loads; smaller tiles leave less of the stem's fold to a part-filled last wave, docs/notes.md
# "Convolution: implicit-GEMM tiling"), 16 and 8 per thread at 4 warps. The interpreter, whose cost is per
# program and per operation, takes 2**16.
UNFOLD_TILE_ELEMENTS = 2**16 if INTERPRETED else 2048
FOLD_TILE_ELEMENTS = 2**16 if INTERPRETED else 1024


def _plane_tile(rows, cols, elements):
    """(rows, cols) of a tile of `elements` over a rows x cols plane: whole rows where they fit, as many
    rows as fill it, at most the plane's."""
    block_cols = min(next_power_of_2(cols), elements)
    return min(elements // block_cols, next_power_of_2(rows)), block_cols


def unfold_tiles(out_height, out_width):
    """(BLOCK_B, BLOCK_OH, BLOCK_OW) of an `Unfold2d` launch: a plane tile, and as many images as fill the
    program when the plane is small (one-image programs of 8x8 tiles wrote the fp32 columns of ResNet-50's
    7x7 planes far below the copy rate; docs/notes.md, "fp32 on tensor cores: tf32x3, bf16x3, rounding")."""
    block_oh, block_ow = _plane_tile(out_height, out_width, UNFOLD_TILE_ELEMENTS)
    return UNFOLD_TILE_ELEMENTS // (block_oh * block_ow), block_oh, block_ow


def fold_tiles(height, width, stride):
    """(BLOCK_I, BLOCK_J) of a `Fold2d` launch: tiles of a stride phase's cdiv(H, S_H) x cdiv(W, S_W) plane."""
    return _plane_tile(cdiv(height, stride[0]), cdiv(width, stride[1]), FOLD_TILE_ELEMENTS)


def _check_sizes(k, a):
    check_output_size("OH", a.OH, a.H, k.dil_h * (k.kh - 1) + 1, k.stride_h, k.pad_h, "H", "DIL_H*(KH-1)+1",
                      "STRIDE_H", "PAD_H")
    check_output_size("OW", a.OW, a.W, k.dil_w * (k.kw - 1) + 1, k.stride_w, k.pad_w, "W", "DIL_W*(KW-1)+1",
                      "STRIDE_W", "PAD_W")
    check_numel("x", a.x, a.PLANES * a.H * a.W, "PLANES*H*W")
    check_numel("columns", a.columns, a.PLANES * k.kh * k.kw * a.OH * a.OW, "PLANES*KH*KW*OH*OW")
    if max(a.PLANES * k.kh * k.kw, a.H * a.W, k.kh * k.kw * a.OH * a.OW) >= 2**31:
        raise ValueError("PLANES: PLANES*KH*KW rows, one H*W plane and one plane's KH*KW*OH*OW columns must each "
                         "hold fewer than 2**31 elements")


def unfold2d_entry(k, a):
    """Grid (cdiv(B, BLOCK_B)*C*KH, cdiv(OH, BLOCK_OH), cdiv(OW, BLOCK_OW)) for `Unfold2d` (C = CHANNELS,
    B = PLANES // C)."""
    if a.CHANNELS < 1 or a.PLANES % a.CHANNELS:
        raise ValueError(f"CHANNELS: expected a positive divisor of PLANES ({a.PLANES}), got {a.CHANNELS}")
    _check_sizes(k, a)
    return check_grid_3d(cdiv(a.PLANES // a.CHANNELS, k.block_b) * a.CHANNELS * k.kh, cdiv(a.OH, k.block_oh),
                         cdiv(a.OW, k.block_ow))


def fold2d_entry(k, a):
    """Grid (PLANES*STRIDE_H*STRIDE_W, cdiv(cdiv(H, STRIDE_H), BLOCK_I), cdiv(cdiv(W, STRIDE_W), BLOCK_J))
    for `Fold2d`."""
    _check_sizes(k, a)
    return check_grid_3d(a.PLANES * k.stride_h * k.stride_w, cdiv(cdiv(a.H, k.stride_h), k.block_i),
                         cdiv(cdiv(a.W, k.stride_w), k.block_j))


@triton.jit
def unfold2d(
    x, columns, PLANES, CHANNELS, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    ROWS_OUTER: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_OH: tl.constexpr, BLOCK_OW: tl.constexpr,
):
    """im2col of PLANES = B*C planes (C = CHANNELS): row r = c*KH*KW + kh*KW + kw of image b's columns is
    tap (kh, kw) of plane b*C + c; `columns` is [B, C*KH*KW, OH, OW], or [C*KH*KW, B, OH, OW] when
    ROWS_OUTER (a row's pixels of every image one run, for 1x1 products that reduce over them).

    Grid: (cdiv(B, BLOCK_B)*C*KH, cdiv(OH, BLOCK_OH), cdiv(OW, BLOCK_OW)). Program ((n*C + c)*KH + kh, i, j)
    writes, for every kw, the images b of block n (BLOCK_B of them: small planes fill a program) and the
    output pixels (oh, ow) of its BLOCK_OH x BLOCK_OW tile inside OH x OW,
        columns[b, r, oh, ow] (or columns[r, b, oh, ow])
            = x[b*C + c, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W],
    0 where that pixel lies in the padding. The KW taps of a row read the same x rows, from L1 after the
    first. With STRIDE_W = 2 each tap loads the window of 2*BLOCK_OW consecutive pixels and keeps the
    even ones (`tl.split`), because element loads 2 apart wrote the columns several times slower
    (docs/notes.md, "Convolution: implicit-GEMM tiling"). Every element of `columns` is written, bit for bit.
    """
    batch = PLANES // CHANNELS
    kh = tl.program_id(0) % KH
    channel = tl.program_id(0) // KH % CHANNELS
    image = tl.program_id(0) // (KH * CHANNELS) * BLOCK_B + tl.arange(0, BLOCK_B)
    oh = tl.program_id(1) * BLOCK_OH + tl.arange(0, BLOCK_OH)
    ow = tl.program_id(2) * BLOCK_OW + tl.arange(0, BLOCK_OW)
    ih = oh * STRIDE_H - PAD_H + kh * DIL_H
    # [BLOCK_B, BLOCK_OH, 1] pointers to the x rows, and their mask
    x_rows = (x + ((image.to(tl.int64) * CHANNELS + channel) * H * W)[:, None, None]
              + (ih * W)[None, :, None])
    rows_ok = (image < batch)[:, None, None] & ((oh < OH) & (ih >= 0) & (ih < H))[None, :, None]
    inside = (image < batch)[:, None, None] & (oh < OH)[None, :, None] & (ow < OW)[None, None, :]
    for kw in tl.static_range(KW):
        if STRIDE_W == 2:
            iw = tl.program_id(2) * BLOCK_OW * 2 - PAD_W + kw * DIL_W + tl.arange(0, BLOCK_OW * 2)
            window = tl.load(x_rows + iw[None, None, :], mask=rows_ok & ((iw >= 0) & (iw < W))[None, None, :],
                             other=0.0)
            values, _ = tl.split(tl.reshape(window, [BLOCK_B, BLOCK_OH, BLOCK_OW, 2]))
        else:
            iw = ow * STRIDE_W - PAD_W + kw * DIL_W
            values = tl.load(x_rows + iw[None, None, :], mask=rows_ok & ((iw >= 0) & (iw < W))[None, None, :],
                             other=0.0)
        row = (channel * KH + kh) * KW + kw
        if ROWS_OUTER:
            row_start = (row.to(tl.int64) * batch + image) * OH * OW
        else:
            row_start = (image.to(tl.int64) * CHANNELS * KH * KW + row) * OH * OW
        tl.store(columns + row_start[:, None, None] + (oh * OW)[None, :, None] + ow[None, None, :], values,
                 mask=inside)


@triton.jit
def fold2d(
    columns, x, PLANES, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """The adjoint of unfold2d (col2im): x[plane, ih, iw] = sum over the taps (kh, kw) and output pixels
    (oh, ow) with ih = oh*STRIDE_H - PAD_H + kh*DIL_H and iw = ow*STRIDE_W - PAD_W + kw*DIL_W of
    columns[plane*KH*KW + kh*KW + kw, oh, ow]; 0 where no tap reads the pixel. `columns` is fp32.

    Grid: (PLANES*STRIDE_H*STRIDE_W, cdiv(cdiv(H, STRIDE_H), BLOCK_I), cdiv(cdiv(W, STRIDE_W), BLOCK_J)).
    Program (plane*STRIDE_H*STRIDE_W + ph*STRIDE_W + pw, ti, tj) writes x[plane, ph + STRIDE_H*i,
    pw + STRIDE_W*j] for the BLOCK_I x BLOCK_J pixels (i, j) of its tile of the stride phase (ph, pw).
    In one phase a tap reads a fixed shift of the output pixels or none (the same for the whole
    program), so each of its loads is a run of consecutive columns. Sums in fp32 in the order of
    the taps, rounded once; every element of x is written once, each column read once.
    """
    phase = tl.program_id(0) % (STRIDE_H * STRIDE_W)
    plane = tl.program_id(0) // (STRIDE_H * STRIDE_W)
    ph = phase // STRIDE_W
    pw = phase % STRIDE_W
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    plane_columns = columns + plane.to(tl.int64) * (KH * KW) * OH * OW
    total = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
    for kh in tl.static_range(KH):
        rise_h = ph + PAD_H - kh * DIL_H  # oh*STRIDE_H - STRIDE_H*i for this tap, where it divides
        if rise_h % STRIDE_H == 0:
            oh = i + rise_h // STRIDE_H
            oh_ok = (oh >= 0) & (oh < OH)
            for kw in tl.static_range(KW):
                rise_w = pw + PAD_W - kw * DIL_W
                if rise_w % STRIDE_W == 0:
                    ow = j + rise_w // STRIDE_W
                    tap = plane_columns + (kh * KW + kw) * OH * OW
                    total += tl.load(tap + oh[:, None] * OW + ow[None, :],
                                     mask=oh_ok[:, None] & ((ow >= 0) & (ow < OW))[None, :], other=0.0)
    ih = ph + STRIDE_H * i
    iw = pw + STRIDE_W * j
    tl.store(x + plane.to(tl.int64) * H * W + ih[:, None] * W + iw[None, :], total.to(x.dtype.element_ty),
             mask=(ih < H)[:, None] & (iw < W)[None, :])


Unfold2d = kernel_object(unfold2d, example=(7, 7, 2, 2, 3, 3, 1, 1, False, 1, 32, 128), entry=unfold2d_entry,
                         flags=("ROWS_OUTER",), nonnegative=("PAD_H", "PAD_W"), num_warps=4)
Fold2d = kernel_object(fold2d, example=(7, 7, 2, 2, 3, 3, 1, 1, 16, 128), entry=fold2d_entry,
                       pointer_dtypes={"columns": torch.float32}, nonnegative=("PAD_H", "PAD_W"), num_warps=4)
