"""Layout change NCHW -> NHWC: `ChannelsLastCopy` (launched by `nnkernels.functional.layout`).

The channels-last convolution kernels read copies of their inputs with channels last. A tile
transpose (a tile read along pixels, written along channels) makes them at about the speed of a
plain copy, several times faster than `t.permute(0, 2, 3, 1).contiguous()` (docs/notes.md, "Layout
copies"). The same kernel turns a weight
[C_OUT, C_IN, KH, KW] into [C_OUT, KH, KW, C_IN] (B = C_OUT, C = C_IN, HW = KH*KW), with tiles
narrowed to its few pixels (`channels_last_tiles`).
"""
import functools

import triton
import triton.language as tl

from ...kernel import INT32_MAX, INTERPRETED, kernel_object
from .checks import check_channel_alignment, check_grid, check_numel
from .host_math import cdiv, channel_alignment, next_power_of_2, power_of_2_at_most
from .tiles import columns_in, known_multiple

# The interpreter runs programs one by one at a fixed cost each: there a tile may cover this
# many elements, so that a small problem takes few programs.
INTERPRETED_TILE_ELEMENTS = 4096


def channels_last_tiles(c, hw, interpreted=INTERPRETED):
    """(BLOCK_C, BLOCK_P) for a [B, c, hw] -> [B, hw, c] copy. Compiled: 4096-element tiles, 64x64 (the
    fastest for a large activation) narrowed to 32 or 16 pixels where hw is smaller than 64, so that a 3x3
    weight (hw = 9) or a 7x7 plane does not leave most of a 64-pixel tile's lanes idle (docs/notes.md,
    "Layout copies"). In the interpreter, one tile of up to 4096 elements covering as much as it can."""
    if not interpreted:
        block_p = min(64, max(16, power_of_2_at_most(hw)))
        return 4096 // block_p, block_p
    block_c = min(next_power_of_2(c), 64)
    block_p = min(next_power_of_2(hw), INTERPRETED_TILE_ELEMENTS // block_c)
    return block_c, block_p


def _copy_grid(names, t_in, t_out, images, rows, cols, block_c, block_p):
    """Programs of one [images, rows, cols] -> [images, cols, rows] tile transpose, after checking its sizes
    against its tensors and that its output does not overlap its input; `names`: (input, output, images,
    rows, cols) as the launch arguments call them."""
    name_in, name_out, name_b, name_c, name_hw = names
    if rows * cols > INT32_MAX:
        raise ValueError(f"{name_c}, {name_hw}: expected {name_c}*{name_hw} <= 2**31 - 1 elements per image, got "
                         f"{rows}*{cols} = {rows * cols}")
    check_numel(name_in, t_in, images * rows * cols, f"{name_b}*{name_c}*{name_hw}")
    check_numel(name_out, t_out, images * cols * rows, f"{name_b}*{name_hw}*{name_c}")
    programs = check_grid(images * cdiv(rows, block_c) * cdiv(cols, block_p))[0]
    _check_apart(name_out, t_out, name_in, t_in)
    return programs


def _check_apart(name_out, t_out, name_other, t_other):
    """Raise unless the memory of t_out (which a copy writes) and t_other do not overlap."""
    out_first, other_first = t_out.data_ptr(), t_other.data_ptr()
    if (out_first < other_first + t_other.numel() * t_other.element_size()
            and other_first < out_first + t_out.numel() * t_out.element_size()):
        raise ValueError(f"{name_out}: expected memory that does not overlap {name_other}'s (the copy reads "
                         f"{name_other} while it writes {name_out})")


def channels_last_copy_entry(k, a):
    """Grid (B * cdiv(C, BLOCK_C) * cdiv(HW, BLOCK_P),) for `ChannelsLastCopy`."""
    check_channel_alignment(k.c_align, a.C)
    check_channel_alignment(k.hw_align, a.HW, "HW_ALIGN", "HW")
    return check_grid(_copy_grid(("x", "y", "B", "C", "HW"), a.x, a.y, a.B, a.C, a.HW, k.block_c, k.block_p))


@triton.jit
def transpose_tile(x, y, tile, C, HW, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, C_ALIGN: tl.constexpr,
                   HW_ALIGN: tl.constexpr):
    """Tile `tile` of the [B, C, HW] -> [B, HW, C] copy, tile = (b*cdiv(C, BLOCK_C) + tc) * cdiv(HW, BLOCK_P)
    + tp: y[b, p, c] = x[b, c, p] for c in [tc*BLOCK_C, (tc+1)*BLOCK_C) and p in [tp*BLOCK_P, (tp+1)*BLOCK_P)
    inside C and HW. C_ALIGN and HW_ALIGN are powers of two dividing C and HW (`host_math.channel_alignment`)
    that the compiler is told, so that rows of x (HW long) load and rows of y (C long) store as vectors."""
    C = known_multiple(C, C_ALIGN)
    HW = known_multiple(HW, HW_ALIGN)
    num_p_tiles = tl.cdiv(HW, BLOCK_P)
    num_c_tiles = tl.cdiv(C, BLOCK_C)
    p_first = (tile % num_p_tiles) * BLOCK_P
    c_first = ((tile // num_p_tiles) % num_c_tiles) * BLOCK_C
    b = tile // (num_p_tiles * num_c_tiles)
    image = b.to(tl.int64) * C * HW
    c = tl.arange(0, BLOCK_C)
    p = tl.arange(0, BLOCK_P)
    inside = columns_in(c_first + c, C, C_ALIGN)[:, None] & columns_in(p_first + p, HW, HW_ALIGN)[None, :]
    # Offsets from the tile's corner stay below C*HW < 2**31 on every lane the mask keeps.
    values = tl.load(x + (image + c_first.to(tl.int64) * HW + p_first) + (c[:, None] * HW + p[None, :]), mask=inside)
    tl.store(y + (image + p_first.to(tl.int64) * C + c_first) + (p[None, :] * C + c[:, None]), values, mask=inside)


@triton.jit
def channels_last_copy(x, y, B, C, HW, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, C_ALIGN: tl.constexpr,
                       HW_ALIGN: tl.constexpr):
    """Copy [B, C, HW] into [B, HW, C] (NCHW -> NHWC with HW = H*W), a tile transpose.

    Grid: (B * cdiv(C, BLOCK_C) * cdiv(HW, BLOCK_P),). Program i, with i = (b*cdiv(C, BLOCK_C) + tc)
    * cdiv(HW, BLOCK_P) + tp, reads the BLOCK_C x BLOCK_P tile of image b at channels
    c in [tc*BLOCK_C, (tc+1)*BLOCK_C) and pixels p in [tp*BLOCK_P, (tp+1)*BLOCK_P) and writes
        y[b, p, c] = x[b, c, p]
    for those inside C and HW. x and y contiguous, not overlapping; C*HW < 2**31 (offsets inside
    one image are i32, image offsets i64); C_ALIGN and HW_ALIGN as in `transpose_tile`. Every element of y is
    written, once, bit for bit.
    """
    transpose_tile(x, y, tl.program_id(0), C, HW, BLOCK_C, BLOCK_P, C_ALIGN, HW_ALIGN)


ChannelsLastCopy = kernel_object(channels_last_copy, example=(64, 64, 1, 1), entry=channels_last_copy_entry,
                                 num_warps=4, helpers=(transpose_tile, columns_in, known_multiple))


def channels_last_copy_pair_entry(k, a):
    """Grid (the x copy's tiles + the weight copy's tiles,) for `ChannelsLastCopyPair`."""
    check_channel_alignment(k.hw_align, a.HW, "HW_ALIGN", "HW")
    x_tiles = _copy_grid(("x", "y", "B", "C", "HW"), a.x, a.y, a.B, a.C, a.HW, k.block_c, k.block_p)
    w_tiles = _copy_grid(("w", "w_cl", "C_OUT", "C_IN", "TAPS"), a.w, a.w_cl, a.C_OUT, a.C_IN, a.TAPS, k.w_block_c,
                         k.w_block_p)
    for name_out, t_out, name_other, t_other in (("y", a.y, "w", a.w), ("w_cl", a.w_cl, "x", a.x),
                                                 ("w_cl", a.w_cl, "y", a.y)):
        _check_apart(name_out, t_out, name_other, t_other)
    return check_grid(x_tiles + w_tiles)


@triton.jit
def channels_last_copy_pair(x, y, B, C, HW, w, w_cl, C_OUT, C_IN, TAPS, BLOCK_C: tl.constexpr,
                            BLOCK_P: tl.constexpr, W_BLOCK_C: tl.constexpr, W_BLOCK_P: tl.constexpr,
                            HW_ALIGN: tl.constexpr):
    """Two channels-last copies in one launch: x [B, C, HW] into y [B, HW, C] in BLOCK_C x BLOCK_P tiles, and a
    convolution weight w [C_OUT, C_IN, TAPS] into w_cl [C_OUT, TAPS, C_IN] in W_BLOCK_C x W_BLOCK_P tiles.

    Grid: (X + Wt,) with X = B*cdiv(C, BLOCK_C)*cdiv(HW, BLOCK_P) and Wt = C_OUT*cdiv(C_IN, W_BLOCK_C)*
    cdiv(TAPS, W_BLOCK_P). Program i < X copies tile i of x as `ChannelsLastCopy`'s program i does; program
    X + j tile j of w. A convolution's forward needs both, and one launch saves a launch's host time and, in
    a CUDA graph, the wait between two kernels. Same contract as `ChannelsLastCopy` for each pair: contiguous,
    not overlapping, fewer than 2**31 elements per image (per weight row); every element of y and w_cl is
    written, once, bit for bit. HW_ALIGN as in `transpose_tile` (the pair serves convolutions whose channels are
    multiples of 16, which the compiler knows already, and whose weights' TAPS are mostly 9).
    """
    pid = tl.program_id(0)
    x_tiles = B * tl.cdiv(C, BLOCK_C) * tl.cdiv(HW, BLOCK_P)
    if pid < x_tiles:
        transpose_tile(x, y, pid, C, HW, BLOCK_C, BLOCK_P, 1, HW_ALIGN)
    else:
        transpose_tile(w, w_cl, pid - x_tiles, C_IN, TAPS, W_BLOCK_C, W_BLOCK_P, 1, 1)


ChannelsLastCopyPair = kernel_object(channels_last_copy_pair, example=(64, 64, 256, 16, 1),
                                     entry=channels_last_copy_pair_entry, num_warps=4,
                                     helpers=(transpose_tile, columns_in, known_multiple))


@functools.lru_cache(maxsize=None)
def channels_last_kernel(rows, cols, dtype):
    """The `ChannelsLastCopy` instance of a [rows, cols] -> [cols, rows] copy of this element type (tiles from
    `channels_last_tiles`, alignments from `channel_alignment`), made once."""
    alignments = (channel_alignment(rows, dtype.itemsize), channel_alignment(cols, dtype.itemsize))
    return ChannelsLastCopy(*channels_last_tiles(rows, cols), *alignments, dtype=dtype)


@functools.lru_cache(maxsize=None)
def channels_last_pair_kernel(c, hw, c_in, taps, dtype):
    """The `ChannelsLastCopyPair` instance for an x of c channels by hw pixels and a weight of c_in channels by
    taps, of this element type, made once."""
    return ChannelsLastCopyPair(*channels_last_tiles(c, hw), *channels_last_tiles(c_in, taps),
                                channel_alignment(hw, dtype.itemsize), dtype=dtype)
