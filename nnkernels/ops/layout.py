"""Layout change NCHW -> NHWC: `ChannelsLastCopy` (launched by `nnkernels.functional.layout`).

The channels-last convolution kernels read copies of their inputs with channels last. Measured
on the H200 (B32 C64 56x56 bf16), `t.permute(0, 2, 3, 1).contiguous()` takes 36 us where one
memory pass at 4.27 TB/s takes 6 us; a tile transpose (a tile read along pixels, written along
channels; 64x64 measured best) took 11.1 us. The same kernel turns a weight
[C_OUT, C_IN, KH, KW] into [C_OUT, KH, KW, C_IN] (B = C_OUT, C = C_IN, HW = KH*KW), with tiles
narrowed to its few pixels (`channels_last_tiles`).
"""
import functools

import triton
import triton.language as tl

from ..kernel import INT32_MAX, INTERPRETED, kernel_object
from .checks import check_grid, check_numel
from .host_math import cdiv, next_power_of_2, power_of_2_at_most

# The interpreter runs programs one by one at a fixed cost each: there a tile may cover this
# many elements, so that a small problem takes few programs.
INTERPRETED_TILE_ELEMENTS = 4096


def channels_last_tiles(c, hw, interpreted=INTERPRETED):
    """(BLOCK_C, BLOCK_P) for a [B, c, hw] -> [B, hw, c] copy. Compiled: 4096-element tiles, 64x64 (measured
    best on the H200 for a B32 C64 56x56 bf16 activation) narrowed to 32 or 16 pixels where hw is smaller
    than 64, so that a 3x3 weight (hw = 9) or a 7x7 plane does not leave most of a 64-pixel tile's lanes
    idle. Measured on the H200 (CUDA-graph replay of the copy alone, µs, 2026-12-02): 512x512x3x3 bf16
    weight 13.8 -> 8.2, 256x256x3x3 fp32 8.2 -> 5.9, B32 C512 7x7 bf16 activation 6.8 -> 5.6. In the
    interpreter, one tile of up to 4096 elements covering as much as it can."""
    if not interpreted:
        block_p = min(64, max(16, power_of_2_at_most(hw)))
        return 4096 // block_p, block_p
    block_c = min(next_power_of_2(c), 64)
    block_p = min(next_power_of_2(hw), INTERPRETED_TILE_ELEMENTS // block_c)
    return block_c, block_p


def channels_last_copy_entry(k, a):
    """Grid (B * cdiv(C, BLOCK_C) * cdiv(HW, BLOCK_P),) for `ChannelsLastCopy`."""
    if a.C * a.HW > INT32_MAX:
        raise ValueError(f"C, HW: expected C*HW <= 2**31 - 1 elements per image, got {a.C}*{a.HW} = {a.C * a.HW}")
    check_numel("x", a.x, a.B * a.C * a.HW, "B*C*HW")
    check_numel("y", a.y, a.B * a.HW * a.C, "B*HW*C")
    grid = check_grid(a.B * cdiv(a.C, k.block_c) * cdiv(a.HW, k.block_p))
    x_first, y_first = a.x.data_ptr(), a.y.data_ptr()
    nbytes = a.x.numel() * a.x.element_size()
    if x_first < y_first + nbytes and y_first < x_first + nbytes:
        raise ValueError("y: expected memory that does not overlap x's (the copy reads x while it writes y)")
    return grid


@triton.jit
def channels_last_copy(x, y, B, C, HW, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """Copy [B, C, HW] into [B, HW, C] (NCHW -> NHWC with HW = H*W), a tile transpose.

    Grid: (B * cdiv(C, BLOCK_C) * cdiv(HW, BLOCK_P),). Program i, with i = (b*cdiv(C, BLOCK_C) + tc)
    * cdiv(HW, BLOCK_P) + tp, reads the BLOCK_C x BLOCK_P tile of image b at channels
    c in [tc*BLOCK_C, (tc+1)*BLOCK_C) and pixels p in [tp*BLOCK_P, (tp+1)*BLOCK_P) and writes
        y[b, p, c] = x[b, c, p]
    for those inside C and HW. x and y contiguous, not overlapping; C*HW < 2**31 (offsets inside
    one image are i32, image offsets i64). Every element of y is written, once, bit for bit.
    """
    pid = tl.program_id(0)
    num_p_tiles = tl.cdiv(HW, BLOCK_P)
    num_c_tiles = tl.cdiv(C, BLOCK_C)
    p_first = (pid % num_p_tiles) * BLOCK_P
    c_first = ((pid // num_p_tiles) % num_c_tiles) * BLOCK_C
    b = pid // (num_p_tiles * num_c_tiles)
    image = b.to(tl.int64) * C * HW
    c = tl.arange(0, BLOCK_C)
    p = tl.arange(0, BLOCK_P)
    inside = ((c_first + c) < C)[:, None] & ((p_first + p) < HW)[None, :]
    # Offsets from the tile's corner stay below C*HW < 2**31 on every lane the mask keeps.
    tile = tl.load(x + (image + c_first.to(tl.int64) * HW + p_first) + (c[:, None] * HW + p[None, :]), mask=inside)
    tl.store(y + (image + p_first.to(tl.int64) * C + c_first) + (p[None, :] * C + c[:, None]), tile, mask=inside)


ChannelsLastCopy = kernel_object(channels_last_copy, example=(64, 64), entry=channels_last_copy_entry, num_warps=4)


@functools.lru_cache(maxsize=None)
def channels_last_kernel(block_c, block_p, dtype):
    """The `ChannelsLastCopy` instance for these tiles and element type, made once."""
    return ChannelsLastCopy(block_c, block_p, dtype=dtype)
