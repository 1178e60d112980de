"""Implicit GEMMs on channels-last tensors (`ops/conv2d/channels_last*.py`): one-group convolutions whose channel
counts are multiples of 16, so that the K slices are whole 16-channel runs loaded as vectors, or of a channels-last
problem other counts of 8 or more (the last slice of a tap masked, still loaded as vectors: `gemm_alignment`). The
forward copies x and the weight (one launch) and may split K; dx reads a channels-last dy (stride-1 dx runs as a
forward, see `Problem.dx_forward`); dw reads dy and x channels-last. Of a channels-last problem (`Problem.nhwc`)
they read x and dy as they are stored and write y and dx channels-last: only the weight is copied.

The forward's candidates meet those of the TMA boxes and Winograd in one tier, and of a 1x1 layer the NCHW
pointwise products' too (each pass); `ranks` places each.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...launcher import Launcher
from ...ops.common.host_math import channel_alignment
from ...ops.conv2d.channels_last import Conv2dGemmClDw, Conv2dGemmClForward, whole_windows, window_width
from ...ops.conv2d.channels_last_dx import Conv2dGemmClDx
from ..layout import (channels_first_copy, channels_first_copy_kernels, channels_last_copy, channels_last_copy_kernels,
                      channels_last_pair_copy, channels_last_pair_kernels, transpose_copy)
from ..common import allocator, channels_last_allocator
from .base import Algorithm, GemmConfig, clamp_pow2, make_kernel, pow2_at_least, pow2_dividing, register
from .grouped import (dw_tap_span, expanded_weight, expanded_weight_kernels, grouped_candidates,
                      grouped_dw_candidates)
from .implicit_gemm import gemm_candidates
from .partials import dw_split, reduce_kernel, split_sum_kernel, split_weight_gradient

# Output planes up to this many pixels (14x14) try the TMA boxes first; larger ones try first 64-pixel tiles of
# several images (`image_pixels`), which leave no ragged tiles.
TMA_FORWARD_FIRST_PIXELS = 256


def image_tile(block_m: int, pixels_per_image: int, image_pixels: int = 0) -> int:
    """BLOCK_Q of the channels-last kernels: the pixels of one image in a tile of `block_m` rows (the rest of the
    tile holds further images); `image_pixels` where a config sets it."""
    return image_pixels or min(block_m, pow2_at_least(pixels_per_image))


def pixel_tiles(config, batch: int, pixels_per_image: int, n: int) -> int:
    """Programs of a channels-last forward or dx launch with `config` (one split)."""
    per_tile = image_tile(config.block_m, pixels_per_image, config.image_pixels)
    return -(-batch // (config.block_m // per_tile)) * -(-pixels_per_image // per_tile) * -(-n // config.block_n)


def split_k(config, programs: int, k: int, machine) -> list:
    """`config`, then, when its `programs` are fewer than the SMs, the same tiles split over K into 2 to 4 slices
    (about two programs per SM, each slice at least four K-steps)."""
    if programs >= machine.sms or k // config.block_k < 8:
        return [config]
    split = max(2, min(4, 2 * machine.sms // programs, k // config.block_k // 4))
    return [config, replace(config, split=split)]


def reduced_slice_limit(c_in: int) -> int:
    """The widest slice of `c_in` channels the channels-last kernels take: one dividing it (whole slices, loaded
    unmasked) where c_in is a multiple of 16, else any (the last one masked)."""
    return pow2_dividing(c_in) if c_in % 16 == 0 else pow2_at_least(c_in)


def channels_last_candidates(batch: int, pixels_per_image: int, n: int, c_in: int, dtype, machine,
                             taps: int = 0) -> list[GemmConfig]:
    """`gemm_candidates` for the channels-last forward and dx kernels. Their pixel tiles take
    `image_tile(block_m, pixels_per_image)` pixels of one image (one phase of one image for dx), so on the GPU a
    tile is no wider than that rounded up to a power of two, and at least the 64 rows of a Hopper warpgroup MMA
    (several small images then share a tile); in the interpreter tiles span many images, for few programs. K
    slices must not straddle taps: BLOCK_K divides `c_in`, the channels reduced over (C_IN for the forward, C_OUT
    for dx), where c_in is a multiple of 16; else (a channels-last problem's) the last slice of a tap is masked.
    When the first guess leaves SMs idle (fewer than two programs per SM), narrower channel tiles go first. With
    `taps` (the forward's KH*KW; its K is taps*c_in): planes of more than TMA_FORWARD_FIRST_PIXELS pixels try
    first 64-pixel tiles of several images (`image_pixels` = 16 or 32 pixels of each, dividing the plane; 64
    channels wide too, which full fp32's registers want), and a tile set with fewer programs than SMs is also
    offered split over K right after itself."""
    limit = reduced_slice_limit(c_in)
    widest = max(64, pow2_at_least(pixels_per_image)) if machine.gpu else 4096
    found = [GemmConfig(min(c.block_m, widest), c.block_n, min(c.block_k, limit), c.num_warps, c.num_stages)
             for c in gemm_candidates(batch * pixels_per_image, n, c_in, dtype, machine)]
    if machine.gpu:
        first = found[0]
        if pixel_tiles(first, batch, pixels_per_image, n) < 2 * machine.sms and first.block_n > 64:
            found.insert(0, GemmConfig(first.block_m, 64, first.block_k, 4, first.num_stages))
        exact = min(32, pow2_dividing(pixels_per_image))
        if taps and pixels_per_image > TMA_FORWARD_FIRST_PIXELS and exact >= 16 and batch >= 64 // exact:
            found[:0] = [GemmConfig(64, block_n, first.block_k, 4, 3, image_pixels=exact)
                         for block_n in dict.fromkeys((first.block_n, min(first.block_n, 64)))]
        if taps:
            found = [split for config in found for split in
                     split_k(config, pixel_tiles(config, batch, pixels_per_image, n), taps * c_in, machine)]
    return list(dict.fromkeys(found))


def channels_last_dw_candidates(m: int, c_in: int, taps: int, pixels: int, dtype, machine) -> list[GemmConfig]:
    """Configs of the channels-last dw kernel. A column tile either lies inside one tap (BLOCK_N divides C_IN) or
    holds all C_IN channels of BLOCK_N/C_IN taps (small power-of-two C_IN: the dy tile is then loaded once for
    several taps). For fp32, unpipelined variants (num_stages=1) first: TF32 tensor cores take operands contiguous
    along the reduced pixels, these are contiguous along channels, and an unpipelined tile is loaded 16 bytes at a
    time and transposed on its way into shared memory; for bf16, 128 x 64 tiles with 8 warps first. A `c_in` that is
    no multiple of 16 has its last column tile of each tap masked."""
    limit = reduced_slice_limit(c_in)
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(m, 16, 64), min(clamp_pow2(c_in * taps, 16, 128), limit),
                           clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    wide = 64 if dtype != torch.float32 else 32
    shapes = [(128, 64, wide, 8, 3, 2), (64, 64, wide, 4, 3, 2), (64, 64, wide, 4, 4, 4), (64, 128, wide, 8, 3, 2),
              (128, 128, wide, 8, 3, 2), (64, 64, wide // 2, 4, 4, 2)]
    if c_in == limit and c_in <= 64:
        shapes += [(64, 2 * c_in, wide, 8, 3, 2), (64, 4 * c_in, wide, 8, 3, 2)]
    if dtype == torch.float32:
        shapes[:0] = [(64, 64, 32, 4, 1, 4), (64, 128, 32, 8, 1, 2), (64, 128, 32, 4, 1, 4)]
    configs = []
    for block_m, block_n, block_k, warps, stages, oversubscribe in shapes:
        block_m = clamp_pow2(m, 16, block_m)
        if block_n > c_in and c_in == limit:  # several taps, at most four (9 taps: 3 tiles of 4)
            block_n = min(block_n, 4 * c_in)
        else:
            block_n = min(block_n, limit)
        span = max(1, block_n // c_in)
        tiles = -(-m // block_m) * -(-taps // span) * -(-c_in // (block_n // span))
        configs.append(GemmConfig(block_m, block_n, block_k, warps, stages,
                                  dw_split(tiles, pixels, block_k, oversubscribe, machine)))
    return list(dict.fromkeys(configs))


def nhwc_operand(p, shape):
    """t -> the [B, H, W, C] tensor the kernels read for an input of NCHW `shape`: of a channels-last problem the
    tensor as it is stored, else the tile transpose's copy of a contiguous one."""
    return _as_stored if p.nhwc else channels_last_copy(shape, p.dtype, p.device)


def nhwc_operand_kernels(p, shape) -> list:
    """The copy `nhwc_operand(p, shape)` launches: none for a channels-last problem."""
    return [] if p.nhwc else channels_last_copy_kernels(shape, p.dtype)


def _as_stored(t):
    return t.permute(0, 2, 3, 1)


def _dx_forward_weight_shape(p):
    return (1, p.C_IN, p.C_OUT * p.KH * p.KW, 1)  # the convolution's own weight, [C_OUT, C_IN, KH, KW], as 4-D


def dx_forward_weight(p):
    """weight -> the weight of `dx_forward` problem p in the channels-last forward's layout, [C_IN, KH, KW, C_OUT],
    taps not flipped (the kernels read them in reverse: FLIP_TAPS): weight as [1, C_OUT, C_IN*KH*KW, 1] made
    channels-last by the tile transpose (torch's permuted copy is slow: its c_out runs lie C_IN*KH*KW apart)."""
    _, rows, cols, _ = _dx_forward_weight_shape(p)
    return transpose_copy(1, rows, cols, (p.C_OUT, p.KH, p.KW, p.C_IN), p.dtype, p.device)


def forward_copies(p, tile_n: int = 0) -> list:
    """The layout copies a channels-last forward launches before its product: x and the weight in one launch (the
    weight alone where x is channels-last, nothing where the weight is too: `Problem.w_nhwc`), or of a `dx_forward`
    problem dy (unless the backward shares its copy or dy is channels-last) and the transposed weight; of a grouped
    problem x (or dy) and the block-diagonal weight of tiles `tile_n` wide (`grouped.expanded_weight`)."""
    if p.grouped:
        return nhwc_operand_kernels(p, p.x_shape) + expanded_weight_kernels(p, tile_n)
    if p.flip_taps:
        return nhwc_operand_kernels(p, p.x_shape) + channels_last_copy_kernels(_dx_forward_weight_shape(p), p.dtype)
    if p.nhwc:
        return [] if p.w_nhwc else channels_last_copy_kernels(p.w_shape, p.dtype)
    return channels_last_pair_kernels(p.x_shape, p.w_shape, p.dtype)


def channels_last_operand_copies(p) -> list:
    """The copies `channels_last_operands` launches: dy, then x (unless the backward made them)."""
    return nhwc_operand_kernels(p, p.y_shape) + nhwc_operand_kernels(p, p.x_shape)


def forward_runner(p, kernels, split, tile_n: int = 0):
    """The runner of a channels-last forward whose `kernels` are its copies (`forward_copies(p, tile_n)`), then
    `Conv2dGemmClForward` or `Conv2dTmaForward`, then the split-K sum when `split` > 1: run(x, weight, bias,
    x_cl=None) -> y. Of a `dx_forward` problem (FLIP_TAPS) it computes dx:
    x is dy, read channels-last (`x_cl`, the backward's shared copy, where it made one), and the weight is the
    convolution's own. Of a channels-last problem y is channels-last, and of one whose weight is too (`w_nhwc`)
    the weight is taken channels-last."""
    conv, *rest = (Launcher(k) for k in kernels[len(forward_copies(p, tile_n)):])
    shape, dtype, sizes, device, c_out = p.y_shape, p.dtype, p.grid_sizes, p.device, p.C_OUT
    numel = p.B * p.C_OUT * p.OH * p.OW
    # y channels-last: NCHW sizes over the NHWC array the kernel writes (Y_NHWC)
    new = channels_last_allocator(dtype, device) if p.nhwc else allocator(dtype, device)
    new_f32 = allocator(torch.float32, device)
    stored = _as_stored if p.nhwc else _same
    no_partials = new_f32(0)
    if p.grouped:
        copy_x, expand = nhwc_operand(p, p.x_shape), expanded_weight(p, tile_n)

        def inputs(x, weight, x_cl):
            return (x_cl if x_cl is not None else copy_x(x)), expand(weight)
    elif p.flip_taps:
        copy_x, transposed = nhwc_operand(p, p.x_shape), dx_forward_weight(p)

        def inputs(x, weight, x_cl):
            return (x_cl if x_cl is not None else copy_x(x)), transposed(weight)
    elif p.nhwc:
        copy_weight = _as_stored if p.w_nhwc else channels_last_copy(p.w_shape, dtype, device)

        def inputs(x, weight, x_cl):
            return _as_stored(x), copy_weight(weight)
    else:
        pair = channels_last_pair_copy(p.x_shape, p.w_shape, dtype, device)

        def inputs(x, weight, x_cl):
            return pair(x, weight)

    if split == 1:
        def run(x, weight, bias, x_cl=None):
            x_in, w_in = inputs(x, weight, x_cl)
            y = new(*shape)
            y_out = stored(y)
            conv(x_in, w_in, y_out if bias is None else bias, y_out, no_partials, *sizes)
            return y

        return run
    total = rest[0]

    def run_split(x, weight, bias, x_cl=None):
        x_in, w_in = inputs(x, weight, x_cl)
        y = new(*shape)
        y_out, partial = stored(y), new_f32(split, numel)
        conv(x_in, w_in, y_out if bias is None else bias, y_out, partial, *sizes)
        total(partial, y_out, y_out, split, numel, c_out)
        return y

    return run_split


def _same(t):
    return t


def gemm_alignment(p) -> int:
    """C_ALIGN of the channels-last GEMMs on p: what the compiler is told of both channel counts of a group."""
    return channel_alignment(math.gcd(p.cin_per_group, p.C_OUT // p.groups), p.dtype.itemsize)


class ClForward(Algorithm):
    name = "cl_forward"
    channels_last_input = True

    def applies(self, p):
        return p.forward_channels_last

    def candidates(self, p):
        if p.grouped:
            return grouped_candidates(p.B, p.OH * p.OW, p.C_OUT // p.groups, p.cin_per_group, p.groups, p.dtype,
                                      p.machine)
        batch, _, _, oh, ow = p.pixel_grid
        return channels_last_candidates(batch, oh * ow, p.C_OUT, p.C_IN, p.dtype, p.machine, taps=p.KH * p.KW)

    def kernels(self, p, config):
        _, _, _, oh, ow = p.pixel_grid
        block_q = image_tile(config.block_m, oh * ow, config.image_pixels)
        whole = whole_windows(p.C_IN, p.cin_per_group, p.C_OUT // p.groups, config.block_n, p.groups, config.block_k)
        constants = p.geometry + (p.groups, whole, p.has_bias, p.tf32, p.flip_taps, p.nhwc, config.block_m,
                                  config.block_n, config.block_k, block_q, config.split, gemm_alignment(p))
        kernels = forward_copies(p, config.block_n) + [make_kernel(Conv2dGemmClForward, constants, p, config)]
        return kernels + ([split_sum_kernel(p, p.B * p.C_OUT * p.OH * p.OW)] if config.split > 1 else [])

    def runner(self, p, config):
        return forward_runner(p, self.kernels(p, config), config.split, config.block_n)


class ClDx(Algorithm):
    """dx from a channels-last dy with the weight as [KH, KW, C_IN, C_OUT] (contiguous along the reduced c_out, as
    TF32 tensor cores want it); strided layers with C_IN a multiple of 16 write NHWC, transposed after (not for a
    channels-last problem, whose dx is NHWC)."""

    name = "cl_dx"
    channels_last_input = True

    def applies(self, p):
        return p.dx_channels_last

    def candidates(self, p):
        if p.grouped:
            return grouped_candidates(p.B, p.pixels_per_phase, p.cin_per_group, p.C_OUT // p.groups, p.groups,
                                      p.dtype, p.machine)
        return channels_last_candidates(*_dx_pixels(p), p.C_IN, p.C_OUT, p.dtype, p.machine)

    def _product(self, p, config):
        block_q = image_tile(config.block_m, _dx_pixels(p)[1])
        whole = whole_windows(p.C_OUT, p.C_OUT // p.groups, p.cin_per_group, config.block_n, p.groups, config.block_k)
        constants = p.geometry + (p.groups, whole, p.tf32, p.dx_nhwc, config.block_m, config.block_n, config.block_k,
                                  block_q, gemm_alignment(p))
        return make_kernel(Conv2dGemmClDx, constants, p, config)

    def kernels(self, p, config):
        transposed = p.dx_nhwc and not p.nhwc
        back_to_nchw = channels_first_copy_kernels((p.B, p.H, p.W, p.C_IN), p.dtype) if transposed else []
        weight = expanded_weight_kernels(p, config.block_n, dx=True) if p.grouped else []
        return nhwc_operand_kernels(p, p.y_shape) + weight + [self._product(p, config)] + back_to_nchw

    def runner(self, p, config):
        launch = Launcher(self._product(p, config))
        copy_dy = nhwc_operand(p, p.y_shape)
        nhwc = (p.B, p.H, p.W, p.C_IN)
        if p.nhwc:  # dx NHWC (`Problem.dx_nhwc`), kept so: NCHW sizes over the NHWC array the kernel writes
            written_shape, laid_out, new = p.x_shape, _same, channels_last_allocator(p.dtype, p.device)
            stored = _as_stored
        else:
            written_shape = nhwc if p.dx_nhwc else p.x_shape
            laid_out = channels_first_copy(nhwc, p.dtype, p.device) if p.dx_nhwc else _same
            new, stored = allocator(p.dtype, p.device), _same
        sizes = p.grid_sizes
        transposed = expanded_weight(p, config.block_n, dx=True) if p.grouped else _dx_weight

        def run(dy, weight, dy_cl):
            w_t = transposed(weight)
            written = new(*written_shape)
            launch(dy_cl if dy_cl is not None else copy_dy(dy), w_t, stored(written), *sizes)
            return laid_out(written)

        return run


def _dx_pixels(p) -> tuple[int, int]:
    """(images, pixels of one stride phase of one) of the channels-last dx's launch (`Problem.pixel_grid`)."""
    return (1, p.B * p.H * p.W) if p.flat_pixels else (p.B, p.pixels_per_phase)


def _dx_weight(weight):
    return weight.permute(2, 3, 1, 0).contiguous()  # [KH, KW, C_IN, C_OUT], `Conv2dGemmClDx`'s w_t: tiny


def tma_rows_fit(p) -> bool:
    """Whether p's channels make rows of TMA boxes (`tma.py`): one group in 16-channel runs, on a GPU with a TMA
    unit. The TMA dx and dw run any stride; the forward one dividing the planes (`tma_boxes_fit`)."""
    return p.whole_channel_runs and p.machine.tma


def tma_boxes_fit(p) -> bool:
    """Whether the TMA forward runs p: `tma_rows_fit`, and a stride that divides x's rows and columns, so that x
    viewed by stride phases is a dense array."""
    return tma_rows_fit(p) and p.H % p.stride[0] == 0 and p.W % p.stride[1] == 0


class ClDw(Algorithm):
    name = "cl_dw"
    channels_last_input = True

    def applies(self, p):
        return p.dw_channels_last and not tma_rows_fit(p)  # there the TMA dw, faster where both ran

    def candidates(self, p):
        if p.grouped:
            return grouped_dw_candidates(p)
        return channels_last_dw_candidates(p.C_OUT, p.C_IN, p.KH * p.KW, p.B * p.OH * p.OW, p.dtype, p.machine)

    def kernels(self, p, config):
        window = window_width(p.C_IN, p.cin_per_group, p.C_OUT // p.groups, config.block_m, p.groups)
        tap_span = dw_tap_span(config.block_n, window)
        whole = whole_windows(p.C_IN, p.cin_per_group, p.C_OUT // p.groups, config.block_m, p.groups,
                              config.block_n // tap_span)
        constants = p.geometry + (p.groups, whole, p.has_bias, p.tf32, config.block_m, config.block_n, config.block_k,
                                  tap_span, gemm_alignment(p))
        return channels_last_operand_copies(p) + [make_kernel(Conv2dGemmClDw, constants, p, config),
                                                  reduce_kernel(p, p.has_bias)]

    def runner(self, p, config):
        product, reduce = (Launcher(k) for k in self.kernels(p, config)[-2:])
        return split_weight_gradient(p, config.split, product, reduce, p.grid_sizes, channels_last_operands(p))


def channels_last_operands(p):
    """(dy, x, copies) -> (channels-last dy, channels-last x): the operands of the channels-last and TMA dw kernels,
    `copies` where the backward made them for dx and dw (`conv._BackwardRunner`), else copied here."""
    copy_dy, copy_x = (nhwc_operand(p, shape) for shape in (p.y_shape, p.x_shape))
    return lambda dy, x, copies: copies if copies is not None else (copy_dy(dy), copy_x(x))


FORWARD = register(ClForward())
DX = register(ClDx())
DW = register(ClDw())
