"""Tuples of accumulator tiles, for kernels that unroll over a band's rows or a program's taps."""
import triton
import triton.language as tl


@triton.jit
def zero_tiles(COUNT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """COUNT fp32 [ROWS, COLS] tiles of zeros, as a tuple (indexed with a compile-time index)."""
    tiles = ()
    for _ in tl.static_range(COUNT):
        tiles = tiles + (tl.zeros([ROWS, COLS], dtype=tl.float32),)
    return tiles
