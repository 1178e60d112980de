"""A grouped convolution's weight as the block-diagonal tiles the channels-last kernels multiply:
`Conv2dGroupedWeight`.

A channels-last product tile of TILE_N output channels spans the groups those channels belong to, and reduces over
the WIDTH channels of those groups (`channels_last.group_window`). Gathered inside the product kernel, each element
of that block-diagonal weight tile costs a scalar load and a group test at every K step; written out once per call
(C_OUT*KH*KW*WIDTH elements, a few hundred KB at most), each tile row is WIDTH contiguous values, zero outside the
row's group; faster on the H200 than the gather (docs/notes.md, "Grouped convolution").
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid_3d, check_numel
from ..common.host_math import cdiv


def conv2d_grouped_weight_entry(k, a):
    """Grid (cdiv(ROWS*TAPS, BLOCK_ROWS), cdiv(WIDTH, BLOCK_J)) for `Conv2dGroupedWeight`."""
    for name in ("ROWS", "TAPS", "N_PER_GROUP", "R_PER_GROUP", "TILE_N", "WIDTH"):
        if getattr(a, name) < 1:
            raise ValueError(f"{name}: expected a positive size, got {getattr(a, name)}")
    if a.ROWS % a.N_PER_GROUP:
        raise ValueError(f"ROWS: expected a multiple of N_PER_GROUP = {a.N_PER_GROUP}, got {a.ROWS}")
    check_numel("src", a.src, a.ROWS * a.R_PER_GROUP * a.TAPS, "ROWS*R_PER_GROUP*TAPS")
    check_numel("out", a.out, a.ROWS * a.TAPS * a.WIDTH, "ROWS*TAPS*WIDTH")
    return check_grid_3d(cdiv(a.ROWS * a.TAPS, k.block_rows), cdiv(a.WIDTH, k.block_j), 1)


@triton.jit
def conv2d_grouped_weight(
    src, out, ROWS, TAPS, N_PER_GROUP, R_PER_GROUP, TILE_N, WIDTH,
    SRC_TRANSPOSED: tl.constexpr, TAPS_OUTER: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """The block-diagonal weight rows of a grouped convolution's channels-last product tiles.

    Grid: (cdiv(ROWS*TAPS, BLOCK_ROWS), cdiv(WIDTH, BLOCK_J)). Rows are pairs (n, t) of a product's channel n <
    ROWS (N_PER_GROUP per group) and tap t < TAPS, row i = t*ROWS + n when TAPS_OUTER, else n*TAPS + t. Program
    (pi, pj) writes, for its BLOCK_ROWS rows and the columns j in [pj*BLOCK_J, (pj+1)*BLOCK_J) below WIDTH,
        out[i*WIDTH + j] = W(n, r, t) if channel first(n) + j = group(n)*R_PER_GROUP + r of n's group, else 0,
    first(n) = ((n // TILE_N) * TILE_N // N_PER_GROUP) * R_PER_GROUP (the first reduced channel of n's tile),
    group(n) = n // N_PER_GROUP. W is the weight src, contiguous [C_OUT, C_IN/G, TAPS]: W(n, r, t) = src[n, r, t]
    (n an output channel, the forward's), or with SRC_TRANSPOSED src[group(n)*R_PER_GROUP + r, n mod N_PER_GROUP,
    t] (n an input channel: dx's). Every element of out is written; values are copied bit for bit.
    """
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    if TAPS_OUTER:
        n = i % ROWS
        t = i // ROWS
    else:
        n = i // TAPS
        t = i % TAPS
    group = n // N_PER_GROUP
    first = ((n // TILE_N) * TILE_N // N_PER_GROUP) * R_PER_GROUP
    r = first[:, None] + j[None, :] - (group * R_PER_GROUP)[:, None]
    written = (i < ROWS * TAPS)[:, None] & (j < WIDTH)[None, :]
    inside = written & (r >= 0) & (r < R_PER_GROUP)
    if SRC_TRANSPOSED:
        offset = ((group * R_PER_GROUP)[:, None] + r) * (N_PER_GROUP * TAPS) + ((n % N_PER_GROUP) * TAPS + t)[:, None]
    else:
        offset = (n * (R_PER_GROUP * TAPS) + t)[:, None] + r * TAPS
    values = tl.load(src + offset, mask=inside, other=0.0)
    tl.store(out + i.to(tl.int64)[:, None] * WIDTH + j[None, :], values, mask=written)


Conv2dGroupedWeight = kernel_object(
    conv2d_grouped_weight,
    example=(False, False, 16, 64),
    entry=conv2d_grouped_weight_entry,
    flags=("SRC_TRANSPOSED", "TAPS_OUTER"),
    num_stages=1,
)
