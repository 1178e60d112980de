"""Implicit-GEMM convolution on channels-last copies: `Conv2dGemmClForward`, `Conv2dGemmClDw`.

Measured on the H200, gathering im2col tiles straight from NCHW is latency-bound: the pixel
axis is only piecewise contiguous and each tap shifts it by an odd number of elements, so
loads are single elements (2 bytes for bf16: too small for asynchronous copies, so no
pipelining). With channels last, a K-slice is BLOCK_K consecutive, aligned channels of one
pixel: 16-byte vector loads that the compiler pipelines. The op makes the channels-last copy
of its NCHW input (one memory pass), or reads a channels-last input as it is; the forward writes y in either
layout (Y_NHWC), dw its own.
Used when groups == 1 and the channel counts are multiples of 16, for channels-last tensors of any channel count
(the last K slice of a tap masked), and for grouped convolutions (not depthwise): a tile then spans the groups of
its output channels with a block-diagonal weight tile.
dx from a channels-last dy is `Conv2dGemmClDx` (conv2d_gemm_channels_last_dx.py).
"""
import math

import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_channel_alignment, check_grid_3d, check_numel
from .partials import PARTIAL_ROW_HELPERS, dw_partial_size, partial_row, split_slice
from .checks import check_conv_launch
from ..common.host_math import cdiv
from ..common.tensor_core import conv_dot
from ..common.tiles import channel_block, columns_in, known_multiple


def check_image_tiles(k):
    """BLOCK_M = (images per tile) * BLOCK_Q: the pixel tiles of the channels-last kernels."""
    if k.block_q > k.block_m or k.block_m % k.block_q:
        raise ValueError(f"block_q: expected a divisor of block_m = {k.block_m}, got {k.block_q}")
    return k.block_m // k.block_q


def check_forward_k_slices(k, a, groups=1, whole=True):
    """The channels-last forwards' K: slices of BLOCK_K channels inside one tap, at most one slice per split
    (grouped: no split); of one group, whole slices (BLOCK_K divides C_IN) unless not `whole` (the last slice of a
    tap then masked); bias and the split's fp32 partials sized to the output."""
    if groups > 1 and k.split_k != 1:
        raise ValueError(f"split_k: expected 1 for a grouped convolution (groups = {groups}), got {k.split_k}")
    if groups == 1 and whole and a.C_IN % k.block_k:
        raise ValueError(f"C_IN: expected a multiple of block_k = {k.block_k}, got {a.C_IN}")
    steps = max(1, k.kh * k.kw * cdiv(a.C_IN, k.block_k))
    if k.split_k > steps:
        raise ValueError(f"split_k: expected at most the {steps} K-steps of block_k = {k.block_k}, got {k.split_k}")
    if k.has_bias:
        check_numel("bias", a.bias, a.C_OUT, "C_OUT")
    if k.split_k > 1:
        check_numel("partial", a.partial, k.split_k * a.B * a.C_OUT * a.OH * a.OW, "SPLIT_K*B*C_OUT*OH*OW")


def conv2d_gemm_cl_forward_entry(k, a):
    """Grid (cdiv(B, images per tile) * pixel tiles per image, c_out tiles, SPLIT_K) for `Conv2dGemmClForward`."""
    cin_per_group, cout_per_group = check_conv_launch(k, a, k.g, weight=k.g == 1)
    if k.g > 1:
        width = window_width(a.C_IN, cin_per_group, cout_per_group, k.block_n, k.g)
        check_numel("w", a.w, a.C_OUT * k.kh * k.kw * width, "C_OUT*KH*KW*WIDTH (`Conv2dGroupedWeight`)")
    check_whole_windows(k, a.C_IN, cin_per_group, cout_per_group, k.block_n, k.block_k)
    check_channel_alignment(k.c_align, math.gcd(cin_per_group, cout_per_group), count="gcd(C_IN/G, C_OUT/G)")
    images = check_image_tiles(k)
    check_forward_k_slices(k, a, k.g, k.whole_windows)
    return check_grid_3d(cdiv(a.B, images) * cdiv(a.OH * a.OW, k.block_q),
                         cdiv(a.C_OUT, k.block_n), k.split_k)


@triton.jit
def image_tile(pid, pixels_per_image, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(b, q) of the BLOCK_M rows of pixel tile `pid` (`check_image_tiles`), pid = g*T + t with T =
    cdiv(pixels_per_image, BLOCK_Q): row r is pixel q = t*BLOCK_Q + r % BLOCK_Q of image b = g*I + r // BLOCK_Q,
    I = BLOCK_M/BLOCK_Q images by BLOCK_Q pixels each."""
    tiles_per_image = tl.cdiv(pixels_per_image, BLOCK_Q)
    row = tl.arange(0, BLOCK_M)
    b = (pid // tiles_per_image) * (BLOCK_M // BLOCK_Q) + row // BLOCK_Q
    q = (pid % tiles_per_image) * BLOCK_Q + row % BLOCK_Q
    return b, q


@triton.jit
def group_window(first, BLOCK: tl.constexpr, out_per_group, in_per_group, in_total):
    """[start, end) of the reduced channels that output channels first, ..., first + BLOCK - 1 read in a grouped
    convolution of `out_per_group` output and `in_per_group` reduced channels per group: their groups' channels."""
    start = (first // out_per_group) * in_per_group
    end = tl.minimum(((first + BLOCK - 1) // out_per_group + 1) * in_per_group, in_total)
    return start, end


@triton.jit
def add_forward_bias(acc, bias, c_out, c_out_ok, HAS_BIAS: tl.constexpr):
    """acc ([pixels, BLOCK_N] fp32 of channels c_out, c_out_ok where they exist) plus bias[c_out] when HAS_BIAS,
    in split 0 only (the channels-last forwards' split K adds the splits after)."""
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            acc += tl.load(bias + c_out, mask=c_out_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def forward_y_offset(b, q, c_out, C_OUT, OHW, Y_NHWC: tl.constexpr):
    """[len(c_out), len(q)] offsets of output channels c_out at pixels q (oh*OW + ow) of images b: into NCHW y,
    or into [B, OH, OW, C_OUT] when Y_NHWC (the channels-last forwards' stores; split partials alike)."""
    if Y_NHWC:
        offset = c_out.to(tl.int64)[:, None] + ((b.to(tl.int64) * OHW + q) * C_OUT)[None, :]
    else:
        offset = (c_out.to(tl.int64) * OHW)[:, None] + (b.to(tl.int64) * C_OUT * OHW + q)[None, :]
    return offset


@triton.jit
def store_forward_tile(acc, y, partial, y_offset, y_ok, B, C_OUT, OHW, SPLIT_K: tl.constexpr):
    """The channels-last forwards' store: acc transposed at y_offset where y_ok, into y in its type
    (SPLIT_K = 1), else in fp32 into this split's row of partial, [SPLIT_K, B*C_OUT*OHW]."""
    if SPLIT_K == 1:
        tl.store(y + y_offset, tl.trans(acc).to(y.dtype.element_ty), mask=y_ok)
    else:
        split_first = tl.program_id(2).to(tl.int64) * B * C_OUT * OHW
        tl.store(partial + split_first + y_offset, tl.trans(acc), mask=y_ok)


@triton.jit
def conv2d_gemm_cl_forward(
    x, w, bias, y, partial, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    G: tl.constexpr, WHOLE_WINDOWS: tl.constexpr, HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    FLIP_TAPS: tl.constexpr, Y_NHWC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr,
    SPLIT_K: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """2-D convolution forward (G groups) from channels-last x and w, NCHW y (NHWC when Y_NHWC); implicit GEMM.

    x is [B, H, W, C_IN] and w is [C_OUT, KH, KW, C_IN], both contiguous, with w's taps in reverse
    order when FLIP_TAPS (w[c_out, KH-1-kh, KW-1-kw, c_in] stands for tap (kh, kw): a stride-1 dx is
    this forward on dy with the weight transposed, and flipped here rather than by another copy);
    a tile's K runs, tap by tap, over the WIDTH input channels of the groups its BLOCK_N output channels belong to
    (`group_window`; G = 1: all C_IN of them, WIDTH = C_IN), the last slice of a tap masked unless
    WHOLE_WINDOWS (`whole_windows`: every window whole and aligned; G = 1: BLOCK_K divides C_IN). G > 1:
    SPLIT_K = 1, and w is [C_OUT, KH, KW, WIDTH], each row those channels' weights, zero outside the row's
    group (`Conv2dGroupedWeight` with TILE_N = BLOCK_N): several narrow groups share one block-diagonal
    tensor-core product. C_ALIGN is a power of two dividing C_IN/G and C_OUT/G (`channel_alignment`), which
    the compiler is told, so that masked slices and channel runs still load as vectors;
    one image of x and one of y hold fewer than 2**31 elements. A pixel tile is I = BLOCK_M/BLOCK_Q
    images by BLOCK_Q pixels of each (I = 1 for large images; several small images per tile).
    Grid: (cdiv(B, I) * cdiv(OH*OW, BLOCK_Q), cdiv(C_OUT, BLOCK_N), SPLIT_K). Program
    (g * cdiv(OH*OW, BLOCK_Q) + t, pn, s) takes the images b in [g*I, (g+1)*I), their pixels
    q = oh*OW + ow in [t*BLOCK_Q, (t+1)*BLOCK_Q), the BLOCK_N channels c_out of tile pn, and the
    K-steps [s*S, min((s+1)*S, KS)) of the KS = KH*KW*cdiv(WIDTH, BLOCK_K) slices of K (each inside one
    tap), S = cdiv(KS, SPLIT_K), and forms
        [bias[c_out] in split 0] + sum over those (kh, kw, c_in of c_out's group) of
            w[c_out, kh, kw, c_in] * x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c_in]
    (x read as 0 outside the image). With SPLIT_K = 1 that is y[b, c_out, oh, ow] (NCHW; y[b, oh, ow,
    c_out] when Y_NHWC); else it goes in fp32 to partial[s] in y's layout and `Conv2dDwReduce`
    (TAPS = 1) adds the splits into y in a fixed order: split K gives layers of few pixels (7x7,
    14x14) more programs.
    A tile's BLOCK_Q pixels of one image are consecutive in NCHW, and the compiler can see it
    (q is BLOCK_Q-contiguous): coalesced stores, measured 4x faster on the H200 than tiles whose
    pixels run across image boundaries.
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 accumulation, y rounded once; every
    element of y (with SPLIT_K > 1: of `partial`, and y is not touched) is written; bias read only
    when HAS_BIAS, `partial` only when SPLIT_K > 1.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    C_IN = known_multiple(C_IN, C_ALIGN)
    C_OUT = known_multiple(C_OUT, C_ALIGN)
    ohw = OH * OW
    b, q = image_tile(pid_m, ohw, BLOCK_M, BLOCK_Q)
    q_ok = (q < ohw) & (b < B)
    ih_first = (q // OW) * STRIDE_H - PAD_H
    iw_first = (q % OW) * STRIDE_W - PAD_W
    # Negative inside an image where the window starts in the padding (those are masked).
    x_pixel = b.to(tl.int64) * H * W * C_IN + (ih_first * W + iw_first) * C_IN
    c_out, c_out_ok = channel_block(pid_n, C_OUT, BLOCK_N, C_ALIGN)
    channel = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if G == 1 and WHOLE_WINDOWS:
        k_total = KH * KW * C_IN
        w_rows = w + c_out.to(tl.int64)[:, None] * k_total
        steps_per_split = tl.cdiv(k_total // BLOCK_K, SPLIT_K)
        k_begin = tl.program_id(2) * steps_per_split * BLOCK_K
        for k_first in range(k_begin, tl.minimum(k_begin + steps_per_split * BLOCK_K, k_total), BLOCK_K):
            tap = k_first // C_IN
            c_first = k_first - tap * C_IN
            dh = (tap // KW) * DIL_H
            dw = (tap % KW) * DIL_W
            inside = q_ok & (ih_first >= -dh) & (ih_first < H - dh) & (iw_first >= -dw) & (iw_first < W - dw)
            x_tile = tl.load(x + x_pixel[:, None] + ((dh * W + dw) * C_IN + c_first + channel)[None, :],
                             mask=inside[:, None], other=0.0)
            if FLIP_TAPS:
                w_k = (KH * KW - 1 - tap) * C_IN + c_first
            else:
                w_k = k_first
            w_tile = tl.load(w_rows + w_k + channel[None, :], mask=c_out_ok[:, None], other=0.0)
            acc = conv_dot(x_tile, tl.trans(w_tile), acc, TF32)
    else:
        cin_per_group = known_multiple(C_IN // G, C_ALIGN)
        cout_per_group = C_OUT // G
        first, end, width, slices = tile_window(pid_n * BLOCK_N, BLOCK_N, cout_per_group, cin_per_group, C_IN, G,
                                                WHOLE_WINDOWS, BLOCK_K)
        w_rows = w + c_out.to(tl.int64)[:, None] * (KH * KW * width)
        step_begin, step_end = split_steps(KH * KW * slices, SPLIT_K)
        for step in range(step_begin, step_end):
            tap = step // slices
            c_in = first + (step % slices) * BLOCK_K + channel
            c_in_ok = window_ok(c_in, end, BLOCK_K, WHOLE_WINDOWS, C_ALIGN)
            dh = (tap // KW) * DIL_H
            dw = (tap % KW) * DIL_W
            inside = q_ok & (ih_first >= -dh) & (ih_first < H - dh) & (iw_first >= -dw) & (iw_first < W - dw)
            x_tile = tl.load(x + x_pixel[:, None] + ((dh * W + dw) * C_IN + c_in)[None, :],
                             mask=inside[:, None] & c_in_ok[None, :], other=0.0)
            if FLIP_TAPS:
                w_tap = KH * KW - 1 - tap
            else:
                w_tap = tap
            w_tile = tl.load(w_rows + (w_tap * width + c_in - first)[None, :],
                             mask=c_out_ok[:, None] & c_in_ok[None, :], other=0.0)
            acc = conv_dot(x_tile, tl.trans(w_tile), acc, TF32)
    acc = add_forward_bias(acc, bias, c_out, c_out_ok, HAS_BIAS)
    y_offset = forward_y_offset(b, q, c_out, C_OUT, ohw, Y_NHWC)
    store_forward_tile(acc, y, partial, y_offset, c_out_ok[:, None] & q_ok[None, :], B, C_OUT, ohw, SPLIT_K)


def conv2d_gemm_cl_dw_entry(k, a):
    """Grid (c_out tiles * (tap groups * channel blocks + has_bias), SPLIT, 1) for `Conv2dGemmClDw`."""
    cin_per_group, cout_per_group = check_conv_launch(k, a, k.g)
    if k.tap_span < 1 or k.tap_span & (k.tap_span - 1) or k.block_n % k.tap_span:
        raise ValueError(f"tap_span: expected a power of two dividing block_n = {k.block_n}, got {k.tap_span}")
    channels_per_tap = k.block_n // k.tap_span
    window = window_width(a.C_IN, cin_per_group, cout_per_group, k.block_m, k.g)
    if k.tap_span > 1 and window != channels_per_tap:
        raise ValueError(f"block_n: expected tap_span * {window} (a tile spanning taps holds all the input channels "
                         f"of its output channels), got {k.block_n}")
    check_channel_alignment(k.c_align, math.gcd(cin_per_group, cout_per_group), count="gcd(C_IN/G, C_OUT/G)")
    if a.SPLIT > a.B * a.OH * a.OW:
        raise ValueError(f"SPLIT: expected at most B*OH*OW = {a.B * a.OH * a.OW} slices, got {a.SPLIT}")
    check_whole_windows(k, a.C_IN, cin_per_group, cout_per_group, k.block_m, channels_per_tap)
    row = dw_partial_size(a.C_OUT, cin_per_group, k.kh, k.kw, k.has_bias)
    check_numel("partial", a.partial, a.SPLIT * row, "SPLIT*(C_OUT*C_IN/G*KH*KW [+ C_OUT with HAS_BIAS])")
    m_tiles = cdiv(a.C_OUT, k.block_m)
    tiles = (m_tiles * cdiv(k.kh * k.kw, k.tap_span) * cdiv(window, channels_per_tap)
             + (m_tiles if k.has_bias else 0))
    return check_grid_3d(tiles, a.SPLIT, 1)


def window_width(c_in, in_per_group, out_per_group, block, groups):
    """Reduced channels a product tile of `block` channels spans (`c_in` in all): all of them for one group, else
    those of the most groups `block` consecutive channels can touch (a tile aligned to whole groups touches
    block / out_per_group)."""
    if groups == 1:
        return c_in
    if block % out_per_group == 0 or out_per_group % block == 0:
        touched = max(1, block // out_per_group)
    else:
        touched = (block - 2) // out_per_group + 2
    return min(groups, touched) * in_per_group


def whole_windows(c_in, in_per_group, out_per_group, block, groups, block_k) -> bool:
    """Whether every tile of `block` channels of a grouped convolution reads a whole window of reduced channels
    (`window_width`, within the `c_in`) that starts at a multiple of it, and `block_k` divides the window: the tile
    holds whole groups (a number dividing `groups`) or lies inside one; of one group, whether `block_k` divides
    `c_in` (its one window). The kernels' WHOLE_WINDOWS: K slices loaded unmasked from an offset the compiler
    knows is a multiple of `block_k`; else the last slice of a window is masked (`window_ok`)."""
    if groups == 1:
        return c_in % block_k == 0
    if out_per_group % block == 0:
        aligned = True
    elif block % out_per_group == 0:
        touched = block // out_per_group
        aligned = touched >= groups or groups % touched == 0
    else:
        aligned = False
    return aligned and window_width(c_in, in_per_group, out_per_group, block, groups) % block_k == 0


def check_whole_windows(k, c_in, in_per_group, out_per_group, block, block_k):
    """A launch's WHOLE_WINDOWS holds only where `whole_windows` says so."""
    if k.whole_windows and not whole_windows(c_in, in_per_group, out_per_group, block, k.g, block_k):
        raise ValueError(f"whole_windows: expected False: tiles of {block} channels ({out_per_group} a group, "
                         f"{k.g} groups) do not read whole windows of {in_per_group}-channel groups in slices of "
                         f"{block_k}")


@triton.jit
def window_start(first, WHOLE_WINDOWS: tl.constexpr, STEP: tl.constexpr):
    """`first` (a multiple of STEP when WHOLE_WINDOWS), then written so that the compiler sees it is one
    (`known_multiple`; `tl.multiple_of` on a helper's argument is lost when it is inlined)."""
    if WHOLE_WINDOWS:
        first = known_multiple(first, STEP)
    return first


@triton.jit
def tile_window(first_out, BLOCK: tl.constexpr, out_per_group, in_per_group, in_total, G: tl.constexpr,
                WHOLE_WINDOWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(first, end, width, slices) of a grouped product tile of BLOCK channels from `first_out`: the reduced
    channels [first, end) it reads (`group_window`), its block-diagonal weight rows' width (`group_window_width`)
    and the BLOCK_K slices over [first, end); first and width seen as multiples of BLOCK_K when WHOLE_WINDOWS."""
    first, end = group_window(first_out, BLOCK, out_per_group, in_per_group, in_total)
    first = window_start(first, WHOLE_WINDOWS, BLOCK_K)
    width = window_start(group_window_width(BLOCK, in_per_group, out_per_group, G), WHOLE_WINDOWS, BLOCK_K)
    return first, end, width, tl.cdiv(end - first, BLOCK_K)


@triton.jit
def window_ok(c, end, BLOCK: tl.constexpr, WHOLE_WINDOWS: tl.constexpr, C_ALIGN: tl.constexpr):
    """[BLOCK] mask of the reduced channels c below the window's `end`: all true, as a constant the compiler sees,
    when WHOLE_WINDOWS; else compared a C_ALIGN group at a time (`columns_in`; the windows' bounds are multiples of
    the kernels' C_ALIGN), so that masked slices still load as vectors."""
    if WHOLE_WINDOWS:
        ok = tl.full([BLOCK], 1, tl.int1)
    else:
        ok = columns_in(c, end, C_ALIGN)
    return ok


@triton.jit
def split_steps(steps, SPLIT_K: tl.constexpr):
    """[begin, end) of this program's K-steps of `steps`: all of them, or its split's cdiv(steps, SPLIT_K) of
    them (split = program_id(2))."""
    if SPLIT_K == 1:
        begin, end = 0, steps
    else:
        per_split = tl.cdiv(steps, SPLIT_K)
        begin = tl.program_id(2) * per_split
        end = tl.minimum(begin + per_split, steps)
    return begin, end


@triton.jit
def group_window_width(BLOCK: tl.constexpr, in_per_group, out_per_group, G: tl.constexpr):
    """`window_width` of a grouped launch (G > 1), in the kernel."""
    aligned = (BLOCK % out_per_group == 0) | (out_per_group % BLOCK == 0)
    touched = tl.where(aligned, tl.maximum(BLOCK // out_per_group, 1), (BLOCK - 2) // out_per_group + 2)
    return tl.minimum(touched, G) * in_per_group


@triton.jit
def conv2d_gemm_cl_dw(
    dy, x, partial, B, C_IN, C_OUT, H, W, OH, OW, SPLIT,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    G: tl.constexpr, WHOLE_WINDOWS: tl.constexpr, HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAP_SPAN: tl.constexpr,
    C_ALIGN: tl.constexpr,
):
    """2-D convolution weight gradient (G groups) from channels-last dy and x, split over pixels.

    dy is [B, OH, OW, C_OUT] and x is [B, H, W, C_IN], both contiguous. A column tile holds
    TAP_SPAN taps by CT = BLOCK_N/TAP_SPAN channels of the tile's window: the input channels its BLOCK_M
    output channels read (all C_IN when G = 1; else those of their groups, from `group_window`, WIN wide at
    most, `window_width`). CT == WIN when TAP_SPAN > 1 (small C_IN: a tile of several taps reuses each dy tile
    for all of them). WHOLE_WINDOWS (`whole_windows` with BLOCK_M and CT): every window whole and aligned (G = 1:
    CT divides C_IN), its x slices loaded unmasked; else the last column tile of a window masked. C_ALIGN as in
    `conv2d_gemm_cl_forward`.
    Grid: (M * cdiv(KH*KW, TAP_SPAN) * cdiv(WIN, CT) + (M when HAS_BIAS), SPLIT, 1), M = cdiv(C_OUT, BLOCK_M).
    Program (tile, s) takes the pixels p = b*OH*OW + oh*OW + ow of slice s, [s*L, min((s+1)*L, B*OH*OW))
    with L = cdiv(cdiv(B*OH*OW, SPLIT), BLOCK_K)*BLOCK_K. A product tile (tile < M * tap groups * blocks),
    with its BLOCK_M channels c_out, its taps tap = kh*KW + kw and its channels c_in of c_out's group, writes
        partial[s, c_out*(C_IN/G)*KH*KW + (c_in - group*C_IN/G)*KH*KW + kh*KW + kw] = sum over p of
            dy[b, oh, ow, c_out] * x[b, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W, c_in]
    (x read as 0 outside the image; a grouped tile's product is computed whole and only its diagonal blocks
    stored); with HAS_BIAS, the M programs after them write, for their BLOCK_M
    channels, partial[s, C_OUT*(C_IN/G)*KH*KW + c_out] = sum over p of dy[b, oh, ow, c_out] (programs of their
    own: `ops.common.tensor_core.sums_beside_dot` says why).
    Tensor-core products (`conv_dot`: fp32 as TF32 or tf32x3), fp32 sums; every element of `partial` is written.
    """
    pid_tile = tl.program_id(0)
    split = tl.program_id(1)
    taps: tl.constexpr = KH * KW
    CT: tl.constexpr = BLOCK_N // TAP_SPAN
    C_IN = known_multiple(C_IN, C_ALIGN)
    C_OUT = known_multiple(C_OUT, C_ALIGN)
    cin_per_group = known_multiple(C_IN // G, C_ALIGN)
    cout_per_group = C_OUT // G
    if G == 1 and WHOLE_WINDOWS:
        channel_blocks = C_IN // CT
    elif G == 1:
        channel_blocks = tl.cdiv(C_IN, CT)
    else:
        channel_blocks = tl.cdiv(group_window_width(BLOCK_M, cin_per_group, cout_per_group, G), CT)
    tiles_per_m = tl.cdiv(taps, TAP_SPAN) * channel_blocks
    product_tiles = tl.cdiv(C_OUT, BLOCK_M) * tiles_per_m
    ohw = OH * OW
    slice_first, slice_end = split_slice(B * ohw, split, SPLIT, BLOCK_K)
    row = partial_row(partial, split, C_OUT * cin_per_group * taps, C_OUT, HAS_BIAS)
    if pid_tile < product_tiles:
        tile_n = pid_tile % tiles_per_m
        tap = (tile_n // channel_blocks) * TAP_SPAN + tl.arange(0, TAP_SPAN)
        tap_ok = tap < taps
        m_first = (pid_tile // tiles_per_m) * BLOCK_M
        if G == 1:
            window_first, window_end = 0, C_IN
        else:
            window_first, window_end = group_window(m_first, BLOCK_M, cout_per_group, cin_per_group, C_IN)
            window_first = window_start(window_first, WHOLE_WINDOWS, CT)
        c_in = window_first + (tile_n % channel_blocks) * CT + tl.arange(0, CT)
        c_in_ok = window_ok(c_in, window_end, CT, WHOLE_WINDOWS, C_ALIGN)
        dh = (tap // KW) * DIL_H
        dw = (tap % KW) * DIL_W
        c_out = m_first + tl.arange(0, BLOCK_M)
        c_out_ok = columns_in(c_out, C_OUT, C_ALIGN)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p_first in range(slice_first, slice_end, BLOCK_K):
            p = p_first + tl.arange(0, BLOCK_K)
            p_ok = p < slice_end
            p_in_image = p % ohw
            ih = ((p_in_image // OW) * STRIDE_H - PAD_H)[:, None] + dh[None, :]
            iw = ((p_in_image % OW) * STRIDE_W - PAD_W)[:, None] + dw[None, :]
            inside = p_ok[:, None] & tap_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            dy_tile = tl.load(dy + (p.to(tl.int64) * C_OUT)[:, None] + c_out[None, :],
                              mask=p_ok[:, None] & c_out_ok[None, :], other=0.0)
            x_pixel = (((p // ohw).to(tl.int64)[:, None] * H + ih) * W + iw) * C_IN
            if G == 1 and WHOLE_WINDOWS:
                x_taps = tl.load(x + x_pixel[:, :, None] + c_in[None, None, :], mask=inside[:, :, None], other=0.0)
            else:
                x_taps = tl.load(x + x_pixel[:, :, None] + c_in[None, None, :],
                                 mask=inside[:, :, None] & c_in_ok[None, None, :], other=0.0)
            x_tile = tl.reshape(x_taps, [BLOCK_K, BLOCK_N])
            acc = conv_dot(tl.trans(dy_tile), x_tile, acc, TF32)
        column_ok = tl.reshape(tap_ok[:, None] & c_in_ok[None, :], [BLOCK_N])
        written = c_out_ok[:, None] & column_ok[None, :]
        if G == 1:
            column = tl.reshape(c_in[None, :] * taps + tap[:, None], [BLOCK_N])
        else:
            column = tl.reshape((c_in % cin_per_group)[None, :] * taps + tap[:, None], [BLOCK_N])
            column_group = tl.reshape(tl.broadcast_to((c_in // cin_per_group)[None, :], [TAP_SPAN, CT]), [BLOCK_N])
            written &= column_group[None, :] == (c_out // cout_per_group)[:, None]
        tl.store(row + (c_out * (cin_per_group * taps))[:, None] + column[None, :], acc, mask=written)
    elif HAS_BIAS:
        c_out, c_out_ok = channel_block(pid_tile - product_tiles, C_OUT, BLOCK_M, C_ALIGN)
        dbias = tl.zeros([BLOCK_M], dtype=tl.float32)
        for p_first in range(slice_first, slice_end, BLOCK_K):
            p = p_first + tl.arange(0, BLOCK_K)
            dy_tile = tl.load(dy + (p.to(tl.int64) * C_OUT)[:, None] + c_out[None, :],
                              mask=(p < slice_end)[:, None] & c_out_ok[None, :], other=0.0)
            dbias += tl.sum(dy_tile.to(tl.float32), axis=0)
        tl.store(row + C_OUT * cin_per_group * taps + c_out, dbias, mask=c_out_ok)


Conv2dGemmClForward = kernel_object(
    conv2d_gemm_cl_forward,
    helpers=(conv_dot, image_tile, group_window, window_start, window_ok, group_window_width, tile_window,
             split_steps, add_forward_bias, forward_y_offset, store_forward_tile, channel_block, columns_in,
             known_multiple),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, True, False, True, False, False, 128, 64, 64, 128, 1, 1),
    entry=conv2d_gemm_cl_forward_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("WHOLE_WINDOWS", "HAS_BIAS", "TF32", "FLIP_TAPS", "Y_NHWC"),
)
Conv2dGemmClDw = kernel_object(
    conv2d_gemm_cl_dw,
    helpers=(conv_dot, group_window, window_start, window_ok, group_window_width, split_slice, channel_block,
             columns_in, known_multiple, *PARTIAL_ROW_HELPERS),
    example=(3, 3, 1, 1, 1, 1, 1, 1, 1, True, False, True, 64, 64, 64, 1, 1),
    entry=conv2d_gemm_cl_dw_entry,
    pointer_dtypes={"partial": torch.float32},
    nonnegative=("PAD_H", "PAD_W"),
    flags=("WHOLE_WINDOWS", "HAS_BIAS", "TF32"),
)
