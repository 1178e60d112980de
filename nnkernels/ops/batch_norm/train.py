"""NCHW batch norm in training mode: batch statistics in fp32, forward and backward, deterministic.

x is viewed as [B, C, HW]. A channel's B*HW elements are cut into tiles of BLOCK_B batch rows
by BLOCK_HW contiguous positions, numbered t = b_tile * cdiv(HW, BLOCK_HW) + hw_tile; program
(c, chunk) of a split kernel owns tiles [chunk*TILES_PER_CHUNK, (chunk+1)*TILES_PER_CHUNK), so
channels few against a large batch still fill the GPU. Per-chunk partials (fp32, [C, chunks] each, the
rows of one `partials` buffer ROW_STRIDE apart) are combined by every consumer in one fixed order, so
results are bitwise reproducible.
A channel that fits one tile takes the fused kernels (one pass): program p owns CHANNELS consecutive
channels c0 = p*CHANNELS.., whose HW positions are, in every image b, one contiguous run of
CHANNELS*HW elements; the tile is [BLOCK_B images, BLOCK_J >= CHANNELS*HW columns] with column
j = (c - c0)*HW + hw, so short spatial rows (7x7) still load long contiguous, aligned rows.
Per-channel sums are segmented sums over the columns (`channel_sums`), exact in fp32. CHANNELS (a launch
argument) and the tile are the caller's (`nnkernels.functional.batchnorm_algorithms` chooses and tunes them).

Forward:  mean, var = batch mean and biased variance; rstd = 1 / sqrt(var + eps);
          y = weight * (x - mean) * rstd + bias; also saved: mean, rstd, var * M/(M-1), M = B*HW.
Backward: dbias = sum(dy); dweight = rstd * sum(dy * (x - mean));
          dx = weight * rstd * (dy - dbias/M - (x - mean) * rstd * dweight/M).
"""
import math

import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_numel
from ..common.host_math import cdiv

F32 = torch.float32

def check_channel_tensors(a, names, length, formula="C"):
    for name in names:
        if hasattr(a, name):
            check_numel(name, getattr(a, name), length, formula)


def check_activations(a, names):
    for name in names:
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.C * a.HW, "B*C*HW")


def split_chunks(k, a):
    """The chunks of TILES_PER_CHUNK tiles that cover a channel's tiles: at most the grid's 65535."""
    if a.TILES_PER_CHUNK < 1:
        raise ValueError(f"TILES_PER_CHUNK: expected at least 1, got {a.TILES_PER_CHUNK}")
    num_chunks = cdiv(cdiv(a.B, k.block_b) * cdiv(a.HW, k.block_hw), a.TILES_PER_CHUNK)
    if num_chunks > 65535:
        raise ValueError(f"TILES_PER_CHUNK: {num_chunks} chunks exceed the 65535 of the grid's second axis")
    return num_chunks


def check_partials(a, rows, length):
    """`partials` holds `rows` rows of `length` values, ROW_STRIDE apart."""
    if a.ROW_STRIDE < length:
        raise ValueError(f"ROW_STRIDE: expected at least the {length} values of a row, got {a.ROW_STRIDE}")
    needed = (rows - 1) * a.ROW_STRIDE + length
    if a.partials.numel() < needed:
        raise ValueError(f"partials: expected at least {rows - 1}*ROW_STRIDE + {length} = {needed} elements "
                         f"({rows} rows), got {a.partials.numel()}")


def partials_entry(rows):
    """The entry of a first pass writing `rows` rows of partials: grid [C, chunks], the chunks
    cdiv(tiles, TILES_PER_CHUNK), each row C * chunks values."""
    def entry(k, a):
        check_activations(a, ("x", "dy"))
        check_channel_tensors(a, ("mean",), a.C)
        num_chunks = split_chunks(k, a)
        check_partials(a, rows, a.C * num_chunks)
        return (a.C, num_chunks)

    return entry


def second_pass_entry(rows):
    """The entry of a second pass reading `rows` rows of partials: grid [C, chunks] over its tiles, each row
    NUM_PARTIALS values per channel."""
    def entry(k, a):
        check_activations(a, ("x", "y", "dy", "dx"))
        check_channel_tensors(a, ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias",
                                  "running_mean", "running_var"), a.C)
        check_partials(a, rows, a.C * a.NUM_PARTIALS)
        if a.NUM_PARTIALS > k.block_partials:
            raise ValueError(f"NUM_PARTIALS: expected at most block_partials = {k.block_partials}, "
                             f"got {a.NUM_PARTIALS}")
        if hasattr(a, "eps") and not a.eps >= 0:
            raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
        return (a.C, split_chunks(k, a))

    return entry


def fused_entry(k, a):
    """Grid [cdiv(C, CHANNELS)]: a tile holds whole channels (BLOCK_B >= B, BLOCK_J >= CHANNELS*HW,
    BLOCK_C >= CHANNELS where the kernel has it), and VECTOR divides every row start and length (the kernel
    tells the compiler so)."""
    if k.block_b < a.B:
        raise ValueError(f"block_b: a fused kernel holds the whole batch, expected >= {a.B}, got {k.block_b}")
    most = getattr(k, "block_c", a.CHANNELS)  # kernels that sum per channel hold BLOCK_C channels
    if not 1 <= a.CHANNELS <= most or a.CHANNELS * a.HW > k.block_j:
        raise ValueError(
            f"CHANNELS: expected 1 <= CHANNELS <= block_c = {most} and CHANNELS*HW <= block_j = {k.block_j}, "
            f"got {a.CHANNELS} (HW = {a.HW})"
        )
    if (a.HW * math.gcd(a.C, a.CHANNELS)) % k.vector:
        raise ValueError(
            f"vector: {k.vector} must divide HW*gcd(C, CHANNELS) = {a.HW * math.gcd(a.C, a.CHANNELS)}, "
            "every row start and length of the tiles"
        )
    if a.B * a.HW < 2 and hasattr(a, "mean"):
        raise ValueError(f"B*HW: expected more than 1 value per channel when training, got {a.B * a.HW}")
    check_activations(a, ("x", "y", "dy", "dx"))
    check_channel_tensors(a, ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias",
                              "running_mean", "running_var", "new_running_mean", "new_running_var"), a.C)
    if hasattr(a, "eps") and not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    return (cdiv(a.C, a.CHANNELS),)


@triton.jit
def chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr):
    """(first, last, hw_tiles): the tiles t in [first, last) of program chunk `chunk` of a split kernel (module
    docstring), of a channel's cdiv(B, BLOCK_B) * hw_tiles tiles, hw_tiles = cdiv(HW, BLOCK_HW) to a row of
    images."""
    hw_tiles = tl.cdiv(HW, BLOCK_HW)
    first = chunk * TILES_PER_CHUNK
    last = tl.minimum(first + TILES_PER_CHUNK, tl.cdiv(B, BLOCK_B) * hw_tiles)
    return first, last, hw_tiles


@triton.jit
def channel_tile(t, hw_tiles, c, B, C, HW, BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr):
    """(offsets, inside) of tile t of channel c of NCHW x: the [BLOCK_B, BLOCK_HW] offsets of its images and
    positions, and where they exist."""
    b = (t // hw_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
    hw = (t % hw_tiles) * BLOCK_HW + tl.arange(0, BLOCK_HW)
    inside = (b < B)[:, None] & (hw < HW)[None, :]
    offsets = ((b.to(tl.int64) * C + c) * HW)[:, None] + hw[None, :]
    return offsets, inside


# The helpers of the split kernels' walk over a chunk's tiles (for their sources and content hash).
CHUNK_WALK = (chunk_tiles, channel_tile)


@triton.jit
def chunk_grad_lane_sums(dy, x, dx, dy_scale, channel_mean, c, chunk, B, C, HW, TILES_PER_CHUNK,
                         BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr):
    """The [BLOCK_B, BLOCK_HW] lane sums, in fp32, of dy and of dy * (x - channel_mean) over the tiles of chunk
    `chunk` of channel c (module docstring), in tile order. Unless dx is None, also writes dx = dy * dy_scale on
    those tiles, in the same pass."""
    first, last, hw_tiles = chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B, BLOCK_HW)
    sum_dy = tl.zeros([BLOCK_B, BLOCK_HW], dtype=tl.float32)
    sum_dy_xmu = tl.zeros([BLOCK_B, BLOCK_HW], dtype=tl.float32)
    for t in range(first, last):
        offsets, inside = channel_tile(t, hw_tiles, c, B, C, HW, BLOCK_B, BLOCK_HW)
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        if dx is not None:
            tl.store(dx + offsets, (dyv * dy_scale).to(dx.dtype.element_ty), mask=inside)
        sum_dy += dyv
        sum_dy_xmu += dyv * tl.where(inside, xv - channel_mean, 0.0)
    return sum_dy, sum_dy_xmu


@triton.jit
def batch_norm2d_partial_stats(
    x, partials, B, C, HW, TILES_PER_CHUNK, ROW_STRIDE,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Per-chunk count, mean and sum of squared deviations (M2) of x, in fp32.

    Means are taken of x - x[0, c, 0] (the channel's first element, the same for every chunk), so a
    partial mean keeps its digits when |mean| >> std; batch_norm2d_train_normalize adds it back.

    Grid: [C, chunks]. Program (c, chunk) reads the tiles of its chunk (module docstring); for each
    tile it takes the corrected two-pass mean and M2 in registers (d = x - sum(x)/n_t;
    mean_t = sum(x)/n_t + sum(d)/n_t; M2_t = sum(d^2) - sum(d)^2/n_t) and merges them into its running
    (count, mean, M2) by Chan's formula:
        delta = mean_t - mean; mean += delta * n_t / n; M2 += M2_t + delta^2 * n_old * n_t / n.
    Writes partials[r * ROW_STRIDE + c * chunks + chunk] for rows r = 0, 1, 2: count, mean, M2; every
    partial is written.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    shift = tl.load(x + c.to(tl.int64) * HW).to(tl.float32)
    first, last, hw_tiles = chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B, BLOCK_HW)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for t in range(first, last):
        b0 = (t // hw_tiles) * BLOCK_B  # the tile's first image and position: its count of values
        hw0 = (t % hw_tiles) * BLOCK_HW
        b = b0 + tl.arange(0, BLOCK_B)
        hw = hw0 + tl.arange(0, BLOCK_HW)
        inside = (b < B)[:, None] & (hw < HW)[None, :]
        offsets = ((b.to(tl.int64) * C + c) * HW)[:, None] + hw[None, :]
        xv = tl.where(inside, tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) - shift, 0.0)
        tile_count = (tl.minimum(B - b0, BLOCK_B) * tl.minimum(HW - hw0, BLOCK_HW)).to(tl.float32)
        rough_mean = tl.sum(tl.sum(xv, axis=1), axis=0) / tile_count
        deviation = tl.where(inside, xv - rough_mean, 0.0)
        residual = tl.sum(tl.sum(deviation, axis=1), axis=0)
        tile_mean = rough_mean + residual / tile_count
        tile_m2 = tl.sum(tl.sum(deviation * deviation, axis=1), axis=0) - residual * residual / tile_count
        merged = count + tile_count
        delta = tile_mean - mean
        mean += delta * (tile_count / merged)
        m2 += tile_m2 + delta * delta * (count * tile_count / merged)
        count = merged
    slot = c * tl.num_programs(1) + chunk
    tl.store(partials + slot, count)
    tl.store(partials + ROW_STRIDE + slot, mean)
    tl.store(partials + 2 * ROW_STRIDE + slot, m2)


@triton.jit
def reversed_chunk():
    """This program's chunk, counted from the grid's last: a second pass over the data of a first pass
    that ran in grid order meets first the chunks that pass read last."""
    return tl.num_programs(1) - 1 - tl.program_id(1)


@triton.jit
def batch_norm2d_train_normalize(
    x, y, weight, bias, partials, mean, rstd, var_unbiased, running_mean, running_var,
    B, C, HW, NUM_PARTIALS, TILES_PER_CHUNK, ROW_STRIDE, eps, momentum,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_PARTIALS: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """Training forward, second pass: merge the statistics partials, then normalise.

    Grid: [C, chunks]. Every program of channel c merges its NUM_PARTIALS partials (of x - x[0, c, 0];
    rows count, mean, M2 of `partials`, ROW_STRIDE apart, as batch_norm2d_partial_stats wrote them)
    in the same order (parallel formula, corrected: n = sum n_i, m = sum n_i*mean_i / n, s_i = mean_i - m,
    mean = m + sum n_i*s_i / n, M2 = sum M2_i + sum n_i*s_i^2 - (sum n_i*s_i)^2 / n), so all
    agree bitwise; program (c, 0) writes
    mean[c], rstd[c] = 1/sqrt(M2/n + eps) and var_unbiased[c] = M2/(n - 1), and with UPDATE_RUNNING
    updates the running statistics in place, as torch does:
        running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c]  (var: var_unbiased[c])
    (without it the running pointers are not touched). Then it writes, on
    the tiles of its chunk, y = (x - mean) * (weight[c] * rstd) + bias[c]. Every y is written.
    Chunks and tiles are taken in the reverse of the statistics pass's order (`reversed_chunk`), so the
    data that pass read last, most likely still in L2, is read first.
    """
    c = tl.program_id(0)
    chunk = reversed_chunk()
    k = tl.arange(0, BLOCK_PARTIALS)
    in_partials = k < NUM_PARTIALS
    at = partials + c * NUM_PARTIALS + k
    counts = tl.load(at, mask=in_partials, other=0.0)
    means = tl.load(at + ROW_STRIDE, mask=in_partials, other=0.0)
    m2s = tl.load(at + 2 * ROW_STRIDE, mask=in_partials, other=0.0)
    count = tl.sum(counts, axis=0)
    rough_mean = tl.sum(counts * means, axis=0) / count
    spread = means - rough_mean
    residual = tl.sum(counts * spread, axis=0)
    channel_mean = tl.load(x + c.to(tl.int64) * HW).to(tl.float32) + (rough_mean + residual / count)
    m2 = tl.sum(m2s, axis=0) + tl.sum(counts * spread * spread, axis=0) - residual * residual / count
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / count + eps))
    if chunk == 0:
        channel_var_unbiased = m2 / (count - 1.0)
        tl.store(mean + c, channel_mean)
        tl.store(rstd + c, channel_rstd)
        tl.store(var_unbiased + c, channel_var_unbiased)
        if UPDATE_RUNNING:
            tl.store(running_mean + c, (1.0 - momentum) * tl.load(running_mean + c) + momentum * channel_mean)
            tl.store(running_var + c, (1.0 - momentum) * tl.load(running_var + c) + momentum * channel_var_unbiased)
    scale = tl.load(weight + c) * channel_rstd
    shift = tl.load(bias + c)
    first, last, hw_tiles = chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B, BLOCK_HW)
    for i in range(first, last):
        t = first + last - 1 - i
        offsets, inside = channel_tile(t, hw_tiles, c, B, C, HW, BLOCK_B, BLOCK_HW)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + offsets, ((xv - channel_mean) * scale + shift).to(y.dtype.element_ty), mask=inside)


@triton.jit
def channel_group_tile(B, C, HW, CHANNELS, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, VECTOR: tl.constexpr):
    """Program p's fused tile (module docstring): returns c0 = p*CHANNELS, the [BLOCK_B, BLOCK_J] offsets
    (b*C + c0)*HW + j and mask, each column's channel j // HW (from 0) and whether the column is in range.
    Row starts and the row length min(CHANNELS, C - c0)*HW are multiples of VECTOR (fused_entry checks it),
    and said to the compiler: launched on 16-byte aligned tensors, the loads and stores take VECTOR
    elements each (16 bytes in fp32 with VECTOR 4; docs/notes.md, "Batch norm")."""
    c0 = tl.program_id(0) * CHANNELS
    row_length = tl.multiple_of(tl.minimum(CHANNELS, C - c0) * HW, VECTOR)
    b = tl.arange(0, BLOCK_B)
    j = tl.arange(0, BLOCK_J)
    row_starts = tl.multiple_of((b.to(tl.int64) * C + c0) * HW, VECTOR)
    in_row = j < row_length
    inside = (b < B)[:, None] & in_row[None, :]
    return c0, row_starts[:, None] + j[None, :], inside, j // HW, in_row


@triton.jit
def channel_sums(columns, member):
    """[BLOCK_C] sums of the [BLOCK_J] columns of each channel (member[j, k]: column j is of channel k).
    Exact: every other term added is +0.0, in a fixed order."""
    return tl.sum(tl.where(member, columns[:, None], 0.0), axis=0)


@triton.jit
def per_column(values, member):
    """[BLOCK_J] values[channel of column j]: the inverse of `channel_sums`, exact (one term is not 0)."""
    return tl.sum(tl.where(member, values[None, :], 0.0), axis=1)


@triton.jit
def update_running_statistics(running_mean, running_var, new_running_mean, new_running_var, c, c_in, batch_mean,
                              batch_var_unbiased, momentum):
    """A training forward's running-statistics update of the channels c where c_in, as torch does it:
        new_running_mean[c] = (1 - momentum) * running_mean[c] + momentum * batch_mean  (var: batch_var_unbiased);
    new_running_* may be running_* (both are read before either is written)."""
    old_mean = tl.load(running_mean + c, mask=c_in)
    old_var = tl.load(running_var + c, mask=c_in)
    tl.store(new_running_mean + c, (1.0 - momentum) * old_mean + momentum * batch_mean, mask=c_in)
    tl.store(new_running_var + c, (1.0 - momentum) * old_var + momentum * batch_var_unbiased, mask=c_in)


@triton.jit
def batch_norm2d_train_forward_fused(
    x, y, weight, bias, mean, rstd, var_unbiased, running_mean, running_var, new_running_mean, new_running_var,
    B, C, HW, CHANNELS, eps, momentum,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, VECTOR: tl.constexpr,
    UPDATE_RUNNING: tl.constexpr,
):
    """Training forward for channels that fit one tile: one pass over x.

    Grid: [cdiv(C, CHANNELS)]. Program p loads x[:, c0:c0+CHANNELS, :] once as one [BLOCK_B, BLOCK_J] tile
    (module docstring), takes each channel's corrected two-pass mean and biased variance in fp32 (as in
    batch_norm2d_partial_stats, sums segmented by `channel_sums`), writes mean[c],
    rstd[c] = 1/sqrt(var + eps), var_unbiased[c] = var * n/(n - 1) (n = B*HW), and
    y = (x - mean) * (weight[c] * rstd) + bias[c]. Every y is written.
    With UPDATE_RUNNING, also the running-statistics update, as torch does it:
        new_running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c]  (var: var_unbiased[c]);
    new_running_* may be running_* (in place: a program reads its channels before it writes them).
    Without it the four running pointers are not touched.
    """
    c0, offsets, inside, column_channel, _ = channel_group_tile(B, C, HW, CHANNELS, BLOCK_B, BLOCK_J, VECTOR)
    k = tl.arange(0, BLOCK_C)
    member = column_channel[:, None] == k[None, :]
    c = c0 + k
    c_in = (k < CHANNELS) & (c < C)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    count = (B * HW).to(tl.float32)
    rough_mean = channel_sums(tl.sum(xv, axis=0), member) / count
    deviation = tl.where(inside, xv - per_column(rough_mean, member)[None, :], 0.0)
    residual = channel_sums(tl.sum(deviation, axis=0), member)
    m2 = channel_sums(tl.sum(deviation * deviation, axis=0), member) - residual * residual / count
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / count + eps))
    batch_mean = rough_mean + residual / count
    batch_var_unbiased = m2 / (count - 1.0)
    tl.store(mean + c, batch_mean, mask=c_in)
    tl.store(rstd + c, channel_rstd, mask=c_in)
    tl.store(var_unbiased + c, batch_var_unbiased, mask=c_in)
    if UPDATE_RUNNING:
        update_running_statistics(running_mean, running_var, new_running_mean, new_running_var, c, c_in, batch_mean,
                                  batch_var_unbiased, momentum)
    scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    shift = tl.load(bias + c, mask=c_in, other=0.0) - (residual / count) * scale
    yv = deviation * per_column(scale, member)[None, :] + per_column(shift, member)[None, :]
    tl.store(y + offsets, yv.to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_partial_grad_sums(
    dy, x, mean, partials, B, C, HW, TILES_PER_CHUNK, ROW_STRIDE,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Training backward, first pass: per-chunk sums of dy and dy * (x - mean[c]) in fp32.

    Grid: [C, chunks]. Program (c, chunk) accumulates over the tiles of its chunk lane by lane, then
    reduces once; writes partials[c * chunks + chunk] = its sum of dy and
    partials[ROW_STRIDE + c * chunks + chunk] = its sum of dy * (x - mean) (all written).
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    channel_mean = tl.load(mean + c)
    sum_dy, sum_dy_xmu = chunk_grad_lane_sums(dy, x, None, None, channel_mean, c, chunk, B, C, HW, TILES_PER_CHUNK,
                                              BLOCK_B, BLOCK_HW)
    slot = c * tl.num_programs(1) + chunk
    tl.store(partials + slot, tl.sum(tl.sum(sum_dy, axis=1), axis=0))
    tl.store(partials + ROW_STRIDE + slot, tl.sum(tl.sum(sum_dy_xmu, axis=1), axis=0))


@triton.jit
def batch_norm2d_train_backward_dx(
    dy, x, dx, weight, mean, rstd, partials, dweight, dbias,
    B, C, HW, NUM_PARTIALS, TILES_PER_CHUNK, ROW_STRIDE,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
):
    """Training backward, second pass: sum the partials in a fixed order, then write dx.

    Grid: [C, chunks]. Every program of channel c sums its NUM_PARTIALS partials (rows sum_dy and
    sum_dy_xmu of `partials`, ROW_STRIDE apart, as batch_norm2d_partial_grad_sums wrote them) the same way;
    program (c, 0) writes dbias[c] = sum_dy and dweight[c] = rstd * sum_dy_xmu. On its tiles:
        dx = weight*rstd*(dy - sum_dy/M) - (x - mean) * weight*rstd^3 * sum_dy_xmu/M,  M = B*HW.
    Every dx is written. Chunks and tiles in the reverse of the sums pass's order, as in
    batch_norm2d_train_normalize.
    """
    c = tl.program_id(0)
    chunk = reversed_chunk()
    k = tl.arange(0, BLOCK_PARTIALS)
    in_partials = k < NUM_PARTIALS
    at = partials + c * NUM_PARTIALS + k
    sum_dy = tl.sum(tl.load(at, mask=in_partials, other=0.0), axis=0)
    sum_dy_xmu = tl.sum(tl.load(at + ROW_STRIDE, mask=in_partials, other=0.0), axis=0)
    channel_mean = tl.load(mean + c)
    channel_rstd = tl.load(rstd + c)
    if chunk == 0:
        tl.store(dbias + c, sum_dy)
        tl.store(dweight + c, sum_dy_xmu * channel_rstd)
    # In fp32, not int32: one channel of a large batch can hold more than 2**31 values.
    count = tl.cast(B, tl.float32) * tl.cast(HW, tl.float32)
    dy_scale = tl.load(weight + c) * channel_rstd
    dy_shift = dy_scale * sum_dy / count
    xmu_scale = dy_scale * channel_rstd * channel_rstd * sum_dy_xmu / count
    first, last, hw_tiles = chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B, BLOCK_HW)
    for i in range(first, last):
        t = first + last - 1 - i
        offsets, inside = channel_tile(t, hw_tiles, c, B, C, HW, BLOCK_B, BLOCK_HW)
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        dxv = dyv * dy_scale - dy_shift - (xv - channel_mean) * xmu_scale
        tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_train_backward_fused(
    dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, CHANNELS,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, VECTOR: tl.constexpr,
):
    """Training backward for channels that fit one tile: one pass over dy and x.

    Grid: [cdiv(C, CHANNELS)]. Program p loads dy and x of channels c0..c0+CHANNELS-1 once, each as one
    [BLOCK_B, BLOCK_J] tile (module docstring), and writes dbias[c] = sum(dy),
    dweight[c] = rstd * sum(dy * (x - mean)) (sums segmented by `channel_sums`) and
        dx = weight*rstd*(dy - dbias/M) - (x - mean) * weight*rstd^3 * sum(dy*(x - mean))/M,  M = B*HW.
    Every dx is written.
    """
    c0, offsets, inside, column_channel, in_row = channel_group_tile(B, C, HW, CHANNELS, BLOCK_B, BLOCK_J, VECTOR)
    k = tl.arange(0, BLOCK_C)
    member = column_channel[:, None] == k[None, :]
    c = c0 + k
    c_in = (k < CHANNELS) & (c < C)
    column_mean = tl.load(mean + c0 + column_channel, mask=in_row, other=0.0)
    dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    xmu = tl.where(inside, xv - column_mean[None, :], 0.0)
    sum_dy = channel_sums(tl.sum(dyv, axis=0), member)
    sum_dy_xmu = channel_sums(tl.sum(dyv * xmu, axis=0), member)
    channel_rstd = tl.load(rstd + c, mask=c_in, other=0.0)
    tl.store(dbias + c, sum_dy, mask=c_in)
    tl.store(dweight + c, sum_dy_xmu * channel_rstd, mask=c_in)
    count = (B * HW).to(tl.float32)
    dy_scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    dy_shift = dy_scale * sum_dy / count
    xmu_scale = dy_scale * channel_rstd * channel_rstd * sum_dy_xmu / count
    dxv = (dyv * per_column(dy_scale, member)[None, :] - per_column(dy_shift, member)[None, :]
           - xmu * per_column(xmu_scale, member)[None, :])
    tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


_STATS = {n: F32 for n in ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias", "running_mean",
                           "running_var", "new_running_mean", "new_running_var", "partials")}

BatchNorm2dPartialStats = kernel_object(
    batch_norm2d_partial_stats, entry=partials_entry(3), example=(8, 256), pointer_dtypes=_STATS, helpers=CHUNK_WALK)
BatchNorm2dTrainNormalize = kernel_object(
    batch_norm2d_train_normalize, entry=second_pass_entry(3), example=(8, 256, 64, True), floats=("eps", "momentum"),
    pointer_dtypes=_STATS, helpers=(reversed_chunk, *CHUNK_WALK), flags=("UPDATE_RUNNING",))
# Fused kernels: by default 8 warps hold a FUSED_TILE-element tile at 32 elements per thread; the functional
# op launches them with the channels per program and num_warps that tuning picks.
FUSED_HELPERS = (channel_group_tile, channel_sums, per_column)
BatchNorm2dTrainForwardFused = kernel_object(
    batch_norm2d_train_forward_fused, entry=fused_entry, example=(4, 32, 256, 4, True), floats=("eps", "momentum"),
    pointer_dtypes=_STATS, num_warps=8, helpers=(*FUSED_HELPERS, update_running_statistics), flags=("UPDATE_RUNNING",))
BatchNorm2dPartialGradSums = kernel_object(
    batch_norm2d_partial_grad_sums, entry=partials_entry(2), example=(8, 256), pointer_dtypes=_STATS,
    helpers=(chunk_grad_lane_sums, *CHUNK_WALK))
BatchNorm2dTrainBackwardDx = kernel_object(
    batch_norm2d_train_backward_dx, entry=second_pass_entry(2), example=(8, 256, 64), pointer_dtypes=_STATS,
    helpers=(reversed_chunk, *CHUNK_WALK))
BatchNorm2dTrainBackwardFused = kernel_object(
    batch_norm2d_train_backward_fused, entry=fused_entry, example=(4, 32, 256, 4), pointer_dtypes=_STATS,
    num_warps=8, helpers=FUSED_HELPERS)
