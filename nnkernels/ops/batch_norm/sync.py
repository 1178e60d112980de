"""Statistics of batch norm over several ranks: per-channel (count, mean, M2) partials merged, in fp32.

A partial is the count n, the mean of x - shift and the sum of squared deviations M2 of some of a channel's
values, with its own shift (a value of the data, so that the mean keeps its digits when |mean| >> std). A
buffer of partials holds four rows, ROW_STRIDE apart: count, mean, M2, shift. Partial k of channel c sits at
c * CHANNEL_STRIDE + k * PARTIAL_STRIDE in rows 0..2 and at c + k * SHIFT_PARTIAL_STRIDE in row 3, so one
kernel reads both a rank's chunks ([C, chunks], one shift per channel) and the rows gathered from every rank
([ranks, 4, ROW_STRIDE]). Merging (Chan's parallel formula, corrected), with ref the shift of the partial of
the largest count:
    d_k = (shift_k - ref) + mean_k;  n = sum n_k;  m = sum n_k*d_k / n;  s_k = d_k - m;
    mean = ref + m + sum n_k*s_k / n;  M2 = sum M2_k + sum n_k*s_k^2 - (sum n_k*s_k)^2 / n.
Partials with n_k = 0 (an empty batch) add nothing, whatever their other rows hold.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_numel
from ..common.host_math import cdiv

F32 = torch.float32


def merge_entry(k, a):
    """Grid [C]; a channel's NUM_PARTIALS partials fit one BLOCK_PARTIALS row, and every read is inside partials."""
    if not 1 <= a.NUM_PARTIALS <= k.block_partials:
        raise ValueError(f"NUM_PARTIALS: expected 1 <= NUM_PARTIALS <= block_partials = {k.block_partials}, "
                         f"got {a.NUM_PARTIALS}")
    last = max(3 * a.ROW_STRIDE + a.C - 1 + (a.NUM_PARTIALS - 1) * a.SHIFT_PARTIAL_STRIDE,
               2 * a.ROW_STRIDE + (a.C - 1) * a.CHANNEL_STRIDE + (a.NUM_PARTIALS - 1) * a.PARTIAL_STRIDE)
    if a.partials.numel() <= last:
        raise ValueError(f"partials: expected more than {last} elements for these strides, got {a.partials.numel()}")
    for name, rows, stride in (("merged", 4, "MERGED_STRIDE"), ("stats", 3, "STATS_STRIDE")):
        if not hasattr(a, name):
            continue
        if getattr(a, stride) < a.C:
            raise ValueError(f"{stride}: expected at least C = {a.C}, got {getattr(a, stride)}")
        if getattr(a, name).numel() < (rows - 1) * getattr(a, stride) + a.C:
            raise ValueError(f"{name}: expected at least {rows - 1}*{stride} + C = "
                             f"{(rows - 1) * getattr(a, stride) + a.C} elements, got {getattr(a, name).numel()}")
    for name in ("running_mean", "running_var"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.C, "C")
    if hasattr(a, "eps") and not a.eps > 0:
        raise ValueError(f"eps: expected a float > 0, got {a.eps}")
    return (a.C,)


@triton.jit
def merged_partials(partials, c, NUM_PARTIALS, ROW_STRIDE, CHANNEL_STRIDE, PARTIAL_STRIDE, SHIFT_PARTIAL_STRIDE,
                    BLOCK_PARTIALS: tl.constexpr):
    """(n, ref, mean of x - ref, M2) of channel c's partials (module docstring), in a fixed order."""
    k = tl.arange(0, BLOCK_PARTIALS)
    at = c.to(tl.int64) * CHANNEL_STRIDE + k.to(tl.int64) * PARTIAL_STRIDE
    inside = k < NUM_PARTIALS
    counts = tl.load(partials + at, mask=inside, other=0.0)
    present = inside & (counts > 0.0)
    means = tl.where(present, tl.load(partials + ROW_STRIDE + at, mask=present, other=0.0), 0.0)
    m2s = tl.where(present, tl.load(partials + 2 * ROW_STRIDE + at, mask=present, other=0.0), 0.0)
    shifts = tl.load(partials + 3 * ROW_STRIDE + c + k.to(tl.int64) * SHIFT_PARTIAL_STRIDE, mask=present, other=0.0)
    largest = tl.argmax(tl.where(inside, counts, -1.0), axis=0)
    ref = tl.sum(tl.where(k == largest, shifts, 0.0), axis=0)
    deviations = tl.where(present, (shifts - ref) + means, 0.0)
    count = tl.sum(counts, axis=0)
    rough_mean = tl.sum(counts * deviations, axis=0) / count
    spread = tl.where(present, deviations - rough_mean, 0.0)
    residual = tl.sum(counts * spread, axis=0)
    m2 = tl.sum(m2s, axis=0) + tl.sum(counts * spread * spread, axis=0) - residual * residual / count
    return count, ref, rough_mean + residual / count, m2


@triton.jit
def batch_norm2d_merge_partial_stats(
    partials, merged, C, NUM_PARTIALS, ROW_STRIDE, CHANNEL_STRIDE, PARTIAL_STRIDE, SHIFT_PARTIAL_STRIDE,
    MERGED_STRIDE, BLOCK_PARTIALS: tl.constexpr,
):
    """One partial per channel from NUM_PARTIALS (a rank's chunks, before they are exchanged).

    Grid: [C]. Program c merges channel c's partials (module docstring) and writes the merged partial, relative
    to ref, into the four rows of `merged` (MERGED_STRIDE apart): merged[c] = n, [MERGED_STRIDE + c] = mean,
    [2*MERGED_STRIDE + c] = M2, [3*MERGED_STRIDE + c] = ref. `merged` may be `partials` where a channel's
    partials are only its own (a program reads them all before it writes).
    """
    c = tl.program_id(0)
    count, ref, mean, m2 = merged_partials(partials, c, NUM_PARTIALS, ROW_STRIDE, CHANNEL_STRIDE, PARTIAL_STRIDE,
                                           SHIFT_PARTIAL_STRIDE, BLOCK_PARTIALS)
    tl.store(merged + c, count)
    tl.store(merged + MERGED_STRIDE + c, mean)
    tl.store(merged + 2 * MERGED_STRIDE + c, m2)
    tl.store(merged + 3 * MERGED_STRIDE + c, ref)


@triton.jit
def batch_norm2d_sync_stats(
    partials, stats, running_mean, running_var, C, NUM_PARTIALS, ROW_STRIDE, CHANNEL_STRIDE, PARTIAL_STRIDE,
    SHIFT_PARTIAL_STRIDE, STATS_STRIDE, eps, momentum, BLOCK_PARTIALS: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """The batch statistics over every rank, from the partials the ranks exchanged.

    Grid: [C]. Program c merges channel c's partials (module docstring; n >= 2) and writes
        stats[c] = mean,  stats[S + c] = var = M2 / n,  stats[2*S + c] = rstd = 1 / sqrt(var + eps)  (S = STATS_STRIDE);
    with UPDATE_RUNNING, also, in place, running_mean = (1 - momentum) * running_mean + momentum * mean and
    running_var = (1 - momentum) * running_var + momentum * M2 / (n - 1). Without it the running pointers are
    not touched.
    """
    c = tl.program_id(0)
    count, ref, mean, m2 = merged_partials(partials, c, NUM_PARTIALS, ROW_STRIDE, CHANNEL_STRIDE, PARTIAL_STRIDE,
                                           SHIFT_PARTIAL_STRIDE, BLOCK_PARTIALS)
    channel_mean = ref + mean
    var = m2 / count
    tl.store(stats + c, channel_mean)
    tl.store(stats + STATS_STRIDE + c, var)
    tl.store(stats + 2 * STATS_STRIDE + c, tl.div_rn(1.0, tl.sqrt_rn(var + eps)))
    if UPDATE_RUNNING:
        old_mean = tl.load(running_mean + c)
        old_var = tl.load(running_var + c)
        tl.store(running_mean + c, (1.0 - momentum) * old_mean + momentum * channel_mean)
        tl.store(running_var + c, (1.0 - momentum) * old_var + momentum * (m2 / (count - 1.0)))


_STATS = {n: F32 for n in ("partials", "merged", "stats", "running_mean", "running_var")}

BatchNorm2dMergePartialStats = kernel_object(
    batch_norm2d_merge_partial_stats, entry=merge_entry, example=(64,), pointer_dtypes=_STATS,
    helpers=(merged_partials,), num_warps=1)
BatchNorm2dSyncStats = kernel_object(
    batch_norm2d_sync_stats, entry=merge_entry, example=(8, True), floats=("eps", "momentum"), pointer_dtypes=_STATS,
    helpers=(merged_partials,), num_warps=1, flags=("UPDATE_RUNNING",))
