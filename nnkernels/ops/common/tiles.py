"""Tiles shared by kernels: tuples of accumulator tiles (for kernels that unroll over a band's rows or a program's
taps), the seed kernels' row tiles, and the channels-last kernels' pixel blocks with their loads and stores."""
import triton
import triton.language as tl


@triton.jit
def zero_tiles(COUNT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """COUNT fp32 [ROWS, COLS] tiles of zeros, as a tuple (indexed with a compile-time index)."""
    tiles = ()
    for _ in tl.static_range(COUNT):
        tiles = tiles + (tl.zeros([ROWS, COLS], dtype=tl.float32),)
    return tiles


@triton.jit
def seed_row_tile(OH, OW, BLOCK_OW: tl.constexpr):
    """The seed kernels' flat grid over output rows, pid = (plane * OH + oh) * cdiv(OW, BLOCK_OW) + ow_tile:
    this program's (plane, oh, ow, ow < OW), ow the BLOCK_OW columns of its tile."""
    pid = tl.program_id(0)
    num_ow_tiles = tl.cdiv(OW, BLOCK_OW)
    oh = (pid // num_ow_tiles) % OH
    plane = pid // num_ow_tiles // OH
    ow = (pid % num_ow_tiles) * BLOCK_OW + tl.arange(0, BLOCK_OW)
    return plane, oh, ow, ow < OW


@triton.jit
def nhwc_pixels(block, OH, OW, BLOCK_P: tl.constexpr):
    """Pixel block `block` of a B x OH x OW grid, pixels numbered (b*OH + row)*OW + column as an NHWC array stores
    them: (pixel index [BLOCK_P], b, row, column)."""
    pixel = block * BLOCK_P + tl.arange(0, BLOCK_P)
    plane = OH * OW
    b = pixel // plane
    rest = pixel - b * plane
    row = rest // OW
    return pixel, b, row, rest - row * OW


@triton.jit
def columns_in(cols, row_length, ROW_ALIGN: tl.constexpr):
    """Which of the columns `cols` are < row_length (a multiple of ROW_ALIGN), compared a ROW_ALIGN group at a
    time: the mask is then constant over each aligned group, which lets its loads and stores be vectors."""
    return (cols // ROW_ALIGN) < (row_length // ROW_ALIGN)


@triton.jit
def channel_block(block, C, BLOCK: tl.constexpr, C_ALIGN: tl.constexpr):
    """Channel block `block` of C (a multiple of C_ALIGN): its channels c = block*BLOCK + [0, BLOCK) and which of
    them exist (`columns_in`)."""
    c = block * BLOCK + tl.arange(0, BLOCK)
    return c, columns_in(c, C, C_ALIGN)


@triton.jit
def known_multiple(n, ALIGN: tl.constexpr):
    """n, a multiple of ALIGN, written (n // ALIGN) * ALIGN so that the compiler sees it is one (a no-op that folds
    away at ALIGN = 1): offsets built from it are then multiples too, and channel runs load as vectors."""
    return (n // ALIGN) * ALIGN


@triton.jit
def nhwc_row(pixel, C, C_ALIGN: tl.constexpr):
    """The offset of pixel `pixel`'s channels in an NHWC array of C channels, in int64; where C_ALIGN > 1 (a power
    of two dividing C) the compiler is told it is a multiple of C_ALIGN, so that channel runs load as vectors."""
    row = pixel.to(tl.int64) * C
    if C_ALIGN > 1:
        row = tl.multiple_of(row, C_ALIGN)
    return row


@triton.jit
def load_nhwc(t, b, row, col, c, ROWS, COLS, C, ok, c_ok, C_ALIGN: tl.constexpr):
    """t[b, row, col, c] of an NHWC array [B, ROWS, COLS, C] as a [P, BLOCK_C] tile, for b, row, col, ok [P] and
    c, c_ok [BLOCK_C]: 0 where ok or c_ok is false or (row, col) falls outside the ROWS x COLS image. C_ALIGN as
    in `nhwc_row`."""
    inside = ok & (row >= 0) & (row < ROWS) & (col >= 0) & (col < COLS)
    pixel = nhwc_row((b * ROWS + row) * COLS + col, C, C_ALIGN)
    return tl.load(t + pixel[:, None] + c[None, :], mask=inside[:, None] & c_ok[None, :], other=0.0)


@triton.jit
def store_nhwc(t, pixel, c, C, values, pixel_ok, c_ok, C_ALIGN: tl.constexpr):
    """t[pixel, c] = values [P, BLOCK_C] (cast to t's type) of the NHWC array t, where pixel_ok and c_ok hold.
    C_ALIGN as in `nhwc_row`."""
    out = nhwc_row(pixel, C, C_ALIGN)
    tl.store(t + out[:, None] + c[None, :], values.to(t.dtype.element_ty), mask=pixel_ok[:, None] & c_ok[None, :])
