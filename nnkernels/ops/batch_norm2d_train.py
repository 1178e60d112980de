"""NCHW batch norm in training mode: batch statistics in fp32, forward and backward, deterministic.

x is viewed as [B, C, HW]. A channel's B*HW elements are cut into tiles of BLOCK_B batch rows
by BLOCK_HW contiguous positions, numbered t = b_tile * cdiv(HW, BLOCK_HW) + hw_tile; program
(c, chunk) of a split kernel owns tiles [chunk*TILES_PER_CHUNK, (chunk+1)*TILES_PER_CHUNK), so
channels few against a large batch still fill the GPU. Per-chunk partials (fp32, [C, chunks])
are combined by every consumer in one fixed order, so results are bitwise reproducible.
A channel that fits one tile takes the fused kernels (one program per channel, one pass).

Forward:  mean, var = batch mean and biased variance; rstd = 1 / sqrt(var + eps);
          y = weight * (x - mean) * rstd + bias; also saved: mean, rstd, var * M/(M-1), M = B*HW.
Backward: dbias = sum(dy); dweight = rstd * sum(dy * (x - mean));
          dx = weight * rstd * (dy - dbias/M - (x - mean) * rstd * dweight/M).
"""
from collections import namedtuple

import torch
import triton
import triton.language as tl

from ..kernel import INTERPRETED, kernel_object
from .checks import check_numel

F32 = torch.float32

# How one batch-norm launch cuts the work; see `batch_norm_plan`.
BatchNormPlan = namedtuple(
    "BatchNormPlan", "block_c block_b block_hw tiles_per_chunk num_chunks block_partials fused")

# On the GPU: about this many elements per tile, and enough programs for several waves on an H200.
GPU_TILE = 2048
GPU_PROGRAMS = 132 * 16
FUSED_LIMIT = 8192
# The interpreter pays per program and per operation, not per element: few, large tiles.
CPU_TILE = 2**16


def _block_hw(HW, tile):
    """The widest power-of-two row (<= tile) that wastes at most 10% of its lanes over HW."""
    widest = min(triton.next_power_of_2(HW), tile)
    for width in (widest >> i for i in range(widest.bit_length())):
        if width >= 16 and HW / (triton.cdiv(HW, width) * width) >= 0.9:
            return width
    return widest


def batch_norm_plan(B, C, HW, *, tile=None, programs=None, fused_limit=None):
    """Tile shape and split of one [B, C, HW] batch-norm problem (keywords override the defaults)."""
    tile = tile or (CPU_TILE if INTERPRETED else GPU_TILE)
    programs = programs or (1 if INTERPRETED else GPU_PROGRAMS)
    whole = triton.next_power_of_2(B) * triton.next_power_of_2(HW)
    if whole <= (fused_limit if fused_limit is not None else CPU_TILE if INTERPRETED else FUSED_LIMIT):
        # One channel per program on the GPU (C of them fill it); as many as fit one tile on the CPU.
        block_c = min(triton.next_power_of_2(C), CPU_TILE // whole) if INTERPRETED else 1
        return BatchNormPlan(block_c, triton.next_power_of_2(B), triton.next_power_of_2(HW), 1, 1, 1, True)
    block_hw = _block_hw(HW, tile)
    block_b = max(1, min(tile // block_hw, triton.next_power_of_2(B)))
    num_tiles = triton.cdiv(B, block_b) * triton.cdiv(HW, block_hw)
    chunks = max(1, min(triton.cdiv(programs, C), num_tiles, 1024))
    tiles_per_chunk = triton.cdiv(num_tiles, chunks)
    chunks = triton.cdiv(num_tiles, tiles_per_chunk)
    return BatchNormPlan(1, block_b, block_hw, tiles_per_chunk, chunks, triton.next_power_of_2(chunks), False)


def check_channel_tensors(a, names, length, formula="C"):
    for name in names:
        if hasattr(a, name):
            check_numel(name, getattr(a, name), length, formula)


def check_activations(a, names):
    for name in names:
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.C * a.HW, "B*C*HW")


def check_split(k, a, num_chunks):
    """The chunks must cover the channel's tiles, and the partials fit one BLOCK_PARTIALS block."""
    num_tiles = triton.cdiv(a.B, k.block_b) * triton.cdiv(a.HW, k.block_hw)
    if triton.cdiv(num_tiles, a.TILES_PER_CHUNK) != num_chunks:
        raise ValueError(
            f"TILES_PER_CHUNK: {a.TILES_PER_CHUNK} tiles per chunk split the {num_tiles} tiles of a channel into "
            f"{triton.cdiv(num_tiles, a.TILES_PER_CHUNK)} chunks, expected {num_chunks}"
        )
    if num_chunks > 65535:
        raise ValueError(f"TILES_PER_CHUNK: {num_chunks} chunks exceed the 65535 of the grid's second axis")


def partial_stats_entry(k, a):
    """Grid [C, chunks]; the partials hold C * chunks values each."""
    check_activations(a, ("x", "dy"))
    check_channel_tensors(a, ("mean",), a.C)
    partials = [n for n in vars(a) if n.startswith("partial_")]
    num_chunks = max(1, getattr(a, partials[0]).numel() // a.C)
    check_channel_tensors(a, partials, a.C * num_chunks, "C*chunks")
    check_split(k, a, num_chunks)
    return (a.C, num_chunks)


def normalize_entry(k, a):
    """Grid [C, chunks] over y's tiles; NUM_PARTIALS stats partials per channel are merged."""
    check_activations(a, ("x", "y", "dy", "dx"))
    check_channel_tensors(a, ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias"), a.C)
    partials = [n for n in vars(a) if n.startswith("partial_")]
    check_channel_tensors(a, partials, a.C * a.NUM_PARTIALS, "C*NUM_PARTIALS")
    if a.NUM_PARTIALS > k.block_partials:
        raise ValueError(f"NUM_PARTIALS: expected at most block_partials = {k.block_partials}, got {a.NUM_PARTIALS}")
    num_tiles = triton.cdiv(a.B, k.block_b) * triton.cdiv(a.HW, k.block_hw)
    if hasattr(a, "eps") and not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    return (a.C, triton.cdiv(num_tiles, a.TILES_PER_CHUNK))


def fused_entry(k, a):
    """Grid [cdiv(C, BLOCK_C)]: one tile must hold whole channels (BLOCK_B >= B, BLOCK_HW >= HW)."""
    if k.block_b < a.B or k.block_hw < a.HW:
        raise ValueError(
            f"block_b, block_hw: a fused kernel holds a whole channel, expected >= ({a.B}, {a.HW}), "
            f"got ({k.block_b}, {k.block_hw})"
        )
    if a.B * a.HW < 2:
        raise ValueError(f"B*HW: expected more than 1 value per channel when training, got {a.B * a.HW}")
    check_activations(a, ("x", "y", "dy", "dx"))
    check_channel_tensors(a, ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias"), a.C)
    if hasattr(a, "eps") and not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    return (triton.cdiv(a.C, k.block_c),)


def update_running_stats_entry(k, a):
    """Grid [cdiv(C, BLOCK_C)]."""
    check_channel_tensors(a, ("running_mean", "running_var", "mean", "var_unbiased"), a.C)
    return (triton.cdiv(a.C, k.block_c),)


@triton.jit
def batch_norm2d_partial_stats(
    x, partial_count, partial_mean, partial_m2, B, C, HW, TILES_PER_CHUNK,
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
    Writes partial_*[c * chunks + chunk]; every partial is written.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    shift = tl.load(x + c.to(tl.int64) * HW).to(tl.float32)
    num_hw_tiles = tl.cdiv(HW, BLOCK_HW)
    first = chunk * TILES_PER_CHUNK
    last = tl.minimum(first + TILES_PER_CHUNK, tl.cdiv(B, BLOCK_B) * num_hw_tiles)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for t in range(first, last):
        b0 = (t // num_hw_tiles) * BLOCK_B
        hw0 = (t % num_hw_tiles) * BLOCK_HW
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
    tl.store(partial_count + slot, count)
    tl.store(partial_mean + slot, mean)
    tl.store(partial_m2 + slot, m2)


@triton.jit
def batch_norm2d_train_normalize(
    x, y, weight, bias, partial_count, partial_mean, partial_m2, mean, rstd, var_unbiased,
    B, C, HW, NUM_PARTIALS, TILES_PER_CHUNK, eps,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
):
    """Training forward, second pass: merge the statistics partials, then normalise.

    Grid: [C, chunks]. Every program of channel c merges its NUM_PARTIALS partials (of x - x[0, c, 0])
    in the same order (parallel formula, corrected: n = sum n_i, m = sum n_i*mean_i / n, s_i = mean_i - m,
    mean = m + sum n_i*s_i / n, M2 = sum M2_i + sum n_i*s_i^2 - (sum n_i*s_i)^2 / n), so all
    agree bitwise; program (c, 0) writes
    mean[c], rstd[c] = 1/sqrt(M2/n + eps) and var_unbiased[c] = M2/(n - 1). Then it writes, on
    the tiles of its chunk, y = (x - mean) * (weight[c] * rstd) + bias[c]. Every y is written.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    k = tl.arange(0, BLOCK_PARTIALS)
    in_partials = k < NUM_PARTIALS
    counts = tl.load(partial_count + c * NUM_PARTIALS + k, mask=in_partials, other=0.0)
    means = tl.load(partial_mean + c * NUM_PARTIALS + k, mask=in_partials, other=0.0)
    m2s = tl.load(partial_m2 + c * NUM_PARTIALS + k, mask=in_partials, other=0.0)
    count = tl.sum(counts, axis=0)
    rough_mean = tl.sum(counts * means, axis=0) / count
    spread = means - rough_mean
    residual = tl.sum(counts * spread, axis=0)
    channel_mean = tl.load(x + c.to(tl.int64) * HW).to(tl.float32) + (rough_mean + residual / count)
    m2 = tl.sum(m2s, axis=0) + tl.sum(counts * spread * spread, axis=0) - residual * residual / count
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / count + eps))
    if chunk == 0:
        tl.store(mean + c, channel_mean)
        tl.store(rstd + c, channel_rstd)
        tl.store(var_unbiased + c, m2 / (count - 1.0))
    scale = tl.load(weight + c) * channel_rstd
    shift = tl.load(bias + c)
    num_hw_tiles = tl.cdiv(HW, BLOCK_HW)
    first = chunk * TILES_PER_CHUNK
    last = tl.minimum(first + TILES_PER_CHUNK, tl.cdiv(B, BLOCK_B) * num_hw_tiles)
    for t in range(first, last):
        b = (t // num_hw_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
        hw = (t % num_hw_tiles) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        inside = (b < B)[:, None] & (hw < HW)[None, :]
        offsets = ((b.to(tl.int64) * C + c) * HW)[:, None] + hw[None, :]
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + offsets, ((xv - channel_mean) * scale + shift).to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_train_forward_fused(
    x, y, weight, bias, mean, rstd, var_unbiased, B, C, HW, eps,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Training forward for channels that fit one tile (BLOCK_B >= B, BLOCK_HW >= HW): one pass.

    Grid: [cdiv(C, BLOCK_C)]. Program p loads x[:, c, :] of its BLOCK_C channels once, takes each
    channel's corrected two-pass mean and biased variance in fp32 (as in batch_norm2d_partial_stats),
    writes mean[c],
    rstd[c] = 1/sqrt(var + eps), var_unbiased[c] = var * n/(n - 1) (n = B*HW), and
    y = (x - mean) * (weight[c] * rstd) + bias[c]. Every y is written.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.arange(0, BLOCK_B)
    hw = tl.arange(0, BLOCK_HW)
    c_in = c < C
    inside = c_in[:, None, None] & (b < B)[None, :, None] & (hw < HW)[None, None, :]
    offsets = ((b.to(tl.int64)[None, :] * C + c[:, None]) * HW)[:, :, None] + hw[None, None, :]
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    count = (B * HW).to(tl.float32)
    rough_mean = tl.sum(tl.sum(xv, axis=2), axis=1) / count
    deviation = tl.where(inside, xv - rough_mean[:, None, None], 0.0)
    residual = tl.sum(tl.sum(deviation, axis=2), axis=1)
    channel_mean = rough_mean + residual / count
    m2 = tl.sum(tl.sum(deviation * deviation, axis=2), axis=1) - residual * residual / count
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / count + eps))
    tl.store(mean + c, channel_mean, mask=c_in)
    tl.store(rstd + c, channel_rstd, mask=c_in)
    tl.store(var_unbiased + c, m2 / (count - 1.0), mask=c_in)
    scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    shift = tl.load(bias + c, mask=c_in, other=0.0)
    yv = (deviation - (residual / count)[:, None, None]) * scale[:, None, None] + shift[:, None, None]
    tl.store(y + offsets, yv.to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_partial_grad_sums(
    dy, x, mean, partial_sum_dy, partial_sum_dy_xmu, B, C, HW, TILES_PER_CHUNK,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Training backward, first pass: per-chunk sums of dy and dy * (x - mean[c]) in fp32.

    Grid: [C, chunks]. Program (c, chunk) accumulates over the tiles of its chunk lane by lane, then
    reduces once; writes partial_sum_dy[c * chunks + chunk] and partial_sum_dy_xmu[...] (all written).
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    channel_mean = tl.load(mean + c)
    num_hw_tiles = tl.cdiv(HW, BLOCK_HW)
    first = chunk * TILES_PER_CHUNK
    last = tl.minimum(first + TILES_PER_CHUNK, tl.cdiv(B, BLOCK_B) * num_hw_tiles)
    sum_dy = tl.zeros([BLOCK_B, BLOCK_HW], dtype=tl.float32)
    sum_dy_xmu = tl.zeros([BLOCK_B, BLOCK_HW], dtype=tl.float32)
    for t in range(first, last):
        b = (t // num_hw_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
        hw = (t % num_hw_tiles) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        inside = (b < B)[:, None] & (hw < HW)[None, :]
        offsets = ((b.to(tl.int64) * C + c) * HW)[:, None] + hw[None, :]
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        sum_dy += dyv
        sum_dy_xmu += dyv * tl.where(inside, xv - channel_mean, 0.0)
    slot = c * tl.num_programs(1) + chunk
    tl.store(partial_sum_dy + slot, tl.sum(tl.sum(sum_dy, axis=1), axis=0))
    tl.store(partial_sum_dy_xmu + slot, tl.sum(tl.sum(sum_dy_xmu, axis=1), axis=0))


@triton.jit
def batch_norm2d_train_backward_dx(
    dy, x, dx, weight, mean, rstd, partial_sum_dy, partial_sum_dy_xmu, dweight, dbias,
    B, C, HW, NUM_PARTIALS, TILES_PER_CHUNK,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
):
    """Training backward, second pass: sum the partials in a fixed order, then write dx.

    Grid: [C, chunks]. Every program of channel c sums its NUM_PARTIALS partials the same way;
    program (c, 0) writes dbias[c] = sum_dy and dweight[c] = rstd * sum_dy_xmu. On its tiles:
        dx = weight*rstd*(dy - sum_dy/M) - (x - mean) * weight*rstd^3 * sum_dy_xmu/M,  M = B*HW.
    Every dx is written.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    k = tl.arange(0, BLOCK_PARTIALS)
    in_partials = k < NUM_PARTIALS
    sum_dy = tl.sum(tl.load(partial_sum_dy + c * NUM_PARTIALS + k, mask=in_partials, other=0.0), axis=0)
    sum_dy_xmu = tl.sum(tl.load(partial_sum_dy_xmu + c * NUM_PARTIALS + k, mask=in_partials, other=0.0), axis=0)
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
    num_hw_tiles = tl.cdiv(HW, BLOCK_HW)
    first = chunk * TILES_PER_CHUNK
    last = tl.minimum(first + TILES_PER_CHUNK, tl.cdiv(B, BLOCK_B) * num_hw_tiles)
    for t in range(first, last):
        b = (t // num_hw_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
        hw = (t % num_hw_tiles) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        inside = (b < B)[:, None] & (hw < HW)[None, :]
        offsets = ((b.to(tl.int64) * C + c) * HW)[:, None] + hw[None, :]
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        dxv = dyv * dy_scale - dy_shift - (xv - channel_mean) * xmu_scale
        tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_train_backward_fused(
    dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Training backward for channels that fit one tile (BLOCK_B >= B, BLOCK_HW >= HW): one pass.

    Grid: [cdiv(C, BLOCK_C)]. Program p loads dy and x of its BLOCK_C channels once and writes
    dbias[c] = sum(dy), dweight[c] = rstd * sum(dy * (x - mean)) and
        dx = weight*rstd*(dy - dbias/M) - (x - mean) * weight*rstd^3 * sum(dy*(x - mean))/M.
    Every dx is written.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.arange(0, BLOCK_B)
    hw = tl.arange(0, BLOCK_HW)
    c_in = c < C
    inside = c_in[:, None, None] & (b < B)[None, :, None] & (hw < HW)[None, None, :]
    offsets = ((b.to(tl.int64)[None, :] * C + c[:, None]) * HW)[:, :, None] + hw[None, None, :]
    channel_mean = tl.load(mean + c, mask=c_in, other=0.0)
    channel_rstd = tl.load(rstd + c, mask=c_in, other=0.0)
    dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    xmu = tl.where(inside, xv - channel_mean[:, None, None], 0.0)
    sum_dy = tl.sum(tl.sum(dyv, axis=2), axis=1)
    sum_dy_xmu = tl.sum(tl.sum(dyv * xmu, axis=2), axis=1)
    tl.store(dbias + c, sum_dy, mask=c_in)
    tl.store(dweight + c, sum_dy_xmu * channel_rstd, mask=c_in)
    count = (B * HW).to(tl.float32)
    dy_scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    dy_shift = dy_scale * sum_dy / count
    xmu_scale = dy_scale * channel_rstd * channel_rstd * sum_dy_xmu / count
    dxv = dyv * dy_scale[:, None, None] - dy_shift[:, None, None] - xmu * xmu_scale[:, None, None]
    tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_update_running_stats(
    running_mean, running_var, mean, var_unbiased, C, momentum, BLOCK_C: tl.constexpr,
):
    """Running-statistics update, in place, as PyTorch does it.

    Grid: [cdiv(C, BLOCK_C)]. For its BLOCK_C channels one program writes
        running_mean = (1 - momentum) * running_mean + momentum * mean
        running_var  = (1 - momentum) * running_var  + momentum * var_unbiased.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = c < C
    old_mean = tl.load(running_mean + c, mask=inside)
    old_var = tl.load(running_var + c, mask=inside)
    new_mean = (1.0 - momentum) * old_mean + momentum * tl.load(mean + c, mask=inside)
    new_var = (1.0 - momentum) * old_var + momentum * tl.load(var_unbiased + c, mask=inside)
    tl.store(running_mean + c, new_mean, mask=inside)
    tl.store(running_var + c, new_var, mask=inside)


_STATS = {n: F32 for n in ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias", "running_mean",
                           "running_var", "partial_count", "partial_mean", "partial_m2", "partial_sum_dy",
                           "partial_sum_dy_xmu")}

BatchNorm2dPartialStats = kernel_object(
    batch_norm2d_partial_stats, entry=partial_stats_entry, example=(8, 256), pointer_dtypes=_STATS)
BatchNorm2dTrainNormalize = kernel_object(
    batch_norm2d_train_normalize, entry=normalize_entry, example=(8, 256, 64), floats=("eps",),
    pointer_dtypes=_STATS)
BatchNorm2dTrainForwardFused = kernel_object(
    batch_norm2d_train_forward_fused, entry=fused_entry, example=(1, 32, 64), floats=("eps",), pointer_dtypes=_STATS)
BatchNorm2dPartialGradSums = kernel_object(
    batch_norm2d_partial_grad_sums, entry=partial_stats_entry, example=(8, 256), pointer_dtypes=_STATS)
BatchNorm2dTrainBackwardDx = kernel_object(
    batch_norm2d_train_backward_dx, entry=normalize_entry, example=(8, 256, 64), pointer_dtypes=_STATS)
BatchNorm2dTrainBackwardFused = kernel_object(
    batch_norm2d_train_backward_fused, entry=fused_entry, example=(1, 32, 64), pointer_dtypes=_STATS)
BatchNorm2dUpdateRunningStats = kernel_object(
    batch_norm2d_update_running_stats, entry=update_running_stats_entry, example=(1024,), floats=("momentum",),
    pointer_dtypes=_STATS)
