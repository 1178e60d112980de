"""Channels-last batch norm: x read where it lies, as [M, C] rows (M = B*H*W) with the channels contiguous.

A tile is BLOCK_M rows by BLOCK_C consecutive channels: every row a contiguous run of BLOCK_C elements, rows C
apart. A reduction over M takes three launches: a split pass writes per-chunk partials (program (cb, chunk) owns
channels cb*BLOCK_C.. and rows [chunk*ROWS_PER_CHUNK, (chunk+1)*ROWS_PER_CHUNK)), a merge pass combines each
channel's partials in one fixed order (results bitwise reproducible), and an elementwise pass over [M, C] tiles
applies them. Partials are fp32, [C, chunks] per row of one `partials` buffer, the rows ROW_STRIDE apart. Where M
is small, one launch does it all: each program walks every row of its channels (`batch_norm2d_nhwc_fused_*`).
The kernels that read [M, C] tiles take C_ALIGN (`host_math.channel_alignment`), so that rows of a C that is not
a multiple of 16 still load and store as vectors.

Forward:    mean, var = batch mean and biased variance; rstd = 1/sqrt(var + eps);
            y = (x - mean) * weight * rstd + bias; also saved: mean, rstd, var * M/(M-1).
Backward:   dbias = sum(dy); dweight = rstd * sum(dy * (x - mean));
            dx = weight*rstd*(dy - dbias/M) - (x - mean) * weight*rstd^2 * dweight/M.
Evaluation: y = (x - running_mean) * weight / sqrt(running_var + eps) + bias.
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_channel_alignment, check_numel
from ..common.host_math import cdiv
from ..common.tiles import columns_in, nhwc_row
from .train import check_channel_tensors, check_partials, update_running_statistics

F32 = torch.float32


def _check_rows(a, names):
    for name in names:
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.M * a.C, "M*C")


def _check_channels(a, names):
    check_channel_tensors(a, names, a.C)


def _chunks(a):
    if a.ROWS_PER_CHUNK < 1:
        raise ValueError(f"ROWS_PER_CHUNK: expected at least 1, got {a.ROWS_PER_CHUNK}")
    chunks = cdiv(a.M, a.ROWS_PER_CHUNK)
    if chunks > 65535:
        raise ValueError(f"ROWS_PER_CHUNK: {chunks} chunks exceed the 65535 of the grid's second axis")
    return chunks


def split_entry(rows):
    """A split pass writing `rows` rows of partials: grid [cdiv(C, BLOCK_C), cdiv(M, ROWS_PER_CHUNK)]."""
    def entry(k, a):
        _check_rows(a, ("x", "dy"))
        _check_channels(a, ("mean",))
        check_channel_alignment(k.c_align, a.C)
        chunks = _chunks(a)
        check_partials(a, rows, a.C * chunks)
        return (cdiv(a.C, k.block_c), chunks)

    return entry


def merge_entry(rows):
    """A merge pass reading `rows` rows of NUM_PARTIALS partials per channel: grid [cdiv(C, BLOCK_C)]."""
    def entry(k, a):
        if a.NUM_PARTIALS < 1:
            raise ValueError(f"NUM_PARTIALS: expected at least 1, got {a.NUM_PARTIALS}")
        check_partials(a, rows, a.C * a.NUM_PARTIALS)
        if hasattr(a, "x") and a.x.numel() < a.C:  # the merge reads the first row of x, the shift of the partials
            raise ValueError(f"x: expected at least a row of C = {a.C} elements, got {a.x.numel()}")
        _check_channels(a, ("mean", "rstd", "var_unbiased", "running_mean", "running_var", "dweight", "dbias"))
        if hasattr(a, "eps") and not a.eps >= 0:
            raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
        return (cdiv(a.C, k.block_c),)

    return entry


def fused_entry(k, a):
    """A pass whose programs each walk all M rows of BLOCK_C channels: grid [cdiv(C, BLOCK_C)]."""
    _check_rows(a, ("x", "y", "dy", "dx"))
    _check_channels(a, ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias", "running_mean",
                        "running_var"))
    check_channel_alignment(k.c_align, a.C)
    if hasattr(a, "eps") and not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    return (cdiv(a.C, k.block_c),)


def elementwise_entry(k, a):
    """Grid [cdiv(C, BLOCK_C) * cdiv(M, BLOCK_M)], one dimension (no 65535 limit on the rows)."""
    _check_rows(a, ("x", "y", "dy", "dx"))
    _check_channels(a, ("weight", "bias", "mean", "rstd", "dweight", "dbias", "running_mean", "running_var"))
    check_channel_alignment(k.c_align, a.C)
    if hasattr(a, "eps") and not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    return (cdiv(a.C, k.block_c) * cdiv(a.M, k.block_m),)


@triton.jit
def nhwc_tile(rows, c, M, C, C_ALIGN: tl.constexpr):
    """The [rows, channels] offsets rows*C + c (int64) and the mask of those inside [M, C], the channels compared
    a C_ALIGN group at a time (`columns_in`, `nhwc_row`: C_ALIGN a power of two dividing C)."""
    inside = (rows < M)[:, None] & columns_in(c, C, C_ALIGN)[None, :]
    return nhwc_row(rows, C, C_ALIGN)[:, None] + c[None, :], inside


@triton.jit
def elementwise_tile(M, C, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr):
    """Program p's tile of an elementwise pass: channel block p % cdiv(C, BLOCK_C), row block p // that.
    Returns the channels, whether each is < C, the offsets and the mask."""
    channel_blocks = tl.cdiv(C, BLOCK_C)
    p = tl.program_id(0)
    c = (p % channel_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = (p // channel_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offsets, inside = nhwc_tile(rows, c, M, C, C_ALIGN)
    return c, columns_in(c, C, C_ALIGN), offsets, inside


@triton.jit
def normalize_tile(x, y, weight, bias, mean, channel_rstd, c, c_in, offsets, inside):
    """y = (x - mean[c]) * (weight[c] * channel_rstd) + bias[c] on one tile, in fp32."""
    scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    channel_mean = tl.load(mean + c, mask=c_in, other=0.0)
    shift = tl.load(bias + c, mask=c_in, other=0.0)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    yv = (xv - channel_mean[None, :]) * scale[None, :] + shift[None, :]
    tl.store(y + offsets, yv.to(y.dtype.element_ty), mask=inside)


@triton.jit
def partial_slots(partials, c, c_in, p0, NUM_PARTIALS, BLOCK_PARTIALS: tl.constexpr):
    """Pointers [BLOCK_C, BLOCK_PARTIALS] to partials p0.. of the channels c in the first row of `partials` (a
    channel's NUM_PARTIALS partials consecutive from c*NUM_PARTIALS), and the mask of those that exist (c_in, and
    p < NUM_PARTIALS)."""
    p = p0 + tl.arange(0, BLOCK_PARTIALS)
    return partials + c[:, None] * NUM_PARTIALS + p[None, :], c_in[:, None] & (p < NUM_PARTIALS)[None, :]


@triton.jit
def sum_partials(partials, c, c_in, NUM_PARTIALS, ROW_STRIDE, BLOCK_C: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
                 WEIGHTED: tl.constexpr):
    """The sums [BLOCK_C] over each channel c's NUM_PARTIALS partials, in BLOCK_PARTIALS-wide steps in a fixed order,
    of row 0's values a_i and of row 1's b_i, or with WEIGHTED of a_i * b_i (0 for the channels not c_in)."""
    sum_first = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_second = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, NUM_PARTIALS, BLOCK_PARTIALS):
        at, present = partial_slots(partials, c, c_in, p0, NUM_PARTIALS, BLOCK_PARTIALS)
        first = tl.load(at, mask=present, other=0.0)
        sum_first += tl.sum(first, axis=1)
        second = tl.load(at + ROW_STRIDE, mask=present, other=0.0)
        if WEIGHTED:
            second = first * second
        sum_second += tl.sum(second, axis=1)
    return sum_first, sum_second


@triton.jit
def store_statistics(mean, rstd, var_unbiased, running_mean, running_var, c, c_in, batch_mean, m2, count, eps,
                     momentum, UPDATE_RUNNING: tl.constexpr):
    """Writes mean[c] = batch_mean, rstd[c] = 1/sqrt(M2/n + eps) and var_unbiased[c] = M2/(n - 1) of the channels c
    where c_in (n = count); with UPDATE_RUNNING, running = (1 - momentum) * running + momentum * statistic (mean;
    var_unbiased) in place, as torch does (without it the running pointers are not touched). Returns rstd."""
    batch_var_unbiased = m2 / tl.maximum(count - 1.0, 1.0)  # the op refuses one value per channel in training
    tl.store(mean + c, batch_mean, mask=c_in)
    variance = tl.where(c_in, m2 / count, 1.0)  # 1 past C: no division by zero where eps is 0
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    tl.store(rstd + c, channel_rstd, mask=c_in)
    tl.store(var_unbiased + c, batch_var_unbiased, mask=c_in)
    if UPDATE_RUNNING:
        update_running_statistics(running_mean, running_var, running_mean, running_var, c, c_in, batch_mean,
                                  batch_var_unbiased, momentum)
    return channel_rstd


@triton.jit
def batch_norm2d_nhwc_partial_stats(
    x, partials, M, C, ROWS_PER_CHUNK, ROW_STRIDE,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Per-chunk count, mean and M2 (sum of squared deviations) of each channel of x, in fp32.

    Means are taken of x - x[0, c] (the channel's first value, the same for every chunk), so that a mean far
    from zero against its spread keeps its digits; batch_norm2d_nhwc_merge_stats adds it back.
    Grid: [cdiv(C, BLOCK_C), chunks]. Program (cb, chunk) walks its rows BLOCK_M at a time; each of the
    [BLOCK_M, BLOCK_C] lanes keeps Welford's running mean and M2 of the rows it meets
    (delta = x - mean; mean += delta / n; M2 += delta * (x - mean)), n counted per row. The lanes of a channel are
    then merged by the parallel formula (n = sum n_l, mean = sum n_l*mean_l / n, M2 = sum M2_l + sum n_l*(mean_l -
    mean)^2). Writes partials[r*ROW_STRIDE + c*chunks + chunk] for rows r = 0, 1, 2: count, mean, M2.
    """
    chunk = tl.program_id(1)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    shift = tl.load(x + c, mask=columns_in(c, C, C_ALIGN), other=0.0).to(tl.float32)
    first = chunk * ROWS_PER_CHUNK
    last = tl.minimum(first + ROWS_PER_CHUNK, M)
    lane_count = tl.zeros([BLOCK_M], dtype=tl.float32)
    lane_mean = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    lane_m2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for row0 in range(first, last, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        offsets, inside = nhwc_tile(rows, c, last, C, C_ALIGN)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) - shift[None, :]
        lane_count += tl.where(rows < last, 1.0, 0.0)
        delta = tl.where(inside, xv - lane_mean, 0.0)
        lane_mean += delta * tl.div_rn(1.0, tl.maximum(lane_count, 1.0))[:, None]
        lane_m2 += tl.where(inside, delta * (xv - lane_mean), 0.0)
    count = tl.sum(lane_count, axis=0)
    mean = tl.sum(lane_mean * lane_count[:, None], axis=0) / count
    spread = lane_mean - mean[None, :]
    m2 = tl.sum(lane_m2, axis=0) + tl.sum(spread * spread * lane_count[:, None], axis=0)
    slot = c * tl.num_programs(1) + chunk
    c_in = columns_in(c, C, C_ALIGN)
    tl.store(partials + slot, tl.zeros([BLOCK_C], dtype=tl.float32) + count, mask=c_in)
    tl.store(partials + ROW_STRIDE + slot, mean, mask=c_in)
    tl.store(partials + 2 * ROW_STRIDE + slot, m2, mask=c_in)


@triton.jit
def batch_norm2d_nhwc_merge_stats(
    x, partials, mean, rstd, var_unbiased, running_mean, running_var, C, NUM_PARTIALS, ROW_STRIDE, eps, momentum,
    BLOCK_C: tl.constexpr, BLOCK_PARTIALS: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """Training forward, merge pass: a channel's statistics from its NUM_PARTIALS partials.

    Grid: [cdiv(C, BLOCK_C)]. For each channel c of its block, in BLOCK_PARTIALS-wide steps over the partials
    (count n_i, mean_i, M2_i of x - x[0, c], as batch_norm2d_nhwc_partial_stats wrote them), by the corrected
    parallel formula: n = sum n_i, m = sum n_i*mean_i / n, s_i = mean_i - m, mean = x[0, c] + m + sum n_i*s_i / n,
    M2 = sum M2_i + sum n_i*s_i^2 - (sum n_i*s_i)^2 / n. Writes mean[c], rstd[c] = 1/sqrt(M2/n + eps) and
    var_unbiased[c] = M2/(n - 1); with UPDATE_RUNNING, running = (1 - momentum) * running + momentum * statistic
    (mean; var_unbiased) in place, as torch does (without it the running pointers are not touched).
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < C
    count, weighted = sum_partials(partials, c, c_in, NUM_PARTIALS, ROW_STRIDE, BLOCK_C, BLOCK_PARTIALS, True)
    rough_mean = weighted / tl.maximum(count, 1.0)
    residual = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, NUM_PARTIALS, BLOCK_PARTIALS):
        at, present = partial_slots(partials, c, c_in, p0, NUM_PARTIALS, BLOCK_PARTIALS)
        counts = tl.load(at, mask=present, other=0.0)
        spread = tl.where(present, tl.load(at + ROW_STRIDE, mask=present, other=0.0) - rough_mean[:, None], 0.0)
        residual += tl.sum(counts * spread, axis=1)
        m2 += tl.sum(tl.load(at + 2 * ROW_STRIDE, mask=present, other=0.0) + counts * spread * spread, axis=1)
    count = tl.maximum(count, 1.0)
    m2 = m2 - residual * residual / count
    batch_mean = tl.load(x + c, mask=c_in, other=0.0).to(tl.float32) + (rough_mean + residual / count)
    store_statistics(mean, rstd, var_unbiased, running_mean, running_var, c, c_in, batch_mean, m2, count, eps, momentum,
                     UPDATE_RUNNING)


@triton.jit
def batch_norm2d_nhwc_normalize(
    x, y, weight, bias, mean, rstd, M, C,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Training forward, elementwise pass: y = (x - mean[c]) * (weight[c] * rstd[c]) + bias[c], in fp32.

    Grid: [cdiv(C, BLOCK_C) * cdiv(M, BLOCK_M)]; program p writes the tile of `elementwise_tile`. Every y is
    written.
    """
    c, c_in, offsets, inside = elementwise_tile(M, C, BLOCK_M, BLOCK_C, C_ALIGN)
    normalize_tile(x, y, weight, bias, mean, tl.load(rstd + c, mask=c_in, other=0.0), c, c_in, offsets, inside)


@triton.jit
def batch_norm2d_nhwc_eval_forward(
    x, y, weight, bias, running_mean, running_var, M, C, eps,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Evaluation forward: y = (x - running_mean[c]) * (weight[c] * rstd[c]) + bias[c],
    rstd = 1/sqrt(running_var[c] + eps), in fp32.

    Grid: [cdiv(C, BLOCK_C) * cdiv(M, BLOCK_M)]; program p writes the tile of `elementwise_tile`. Every y is
    written.
    """
    c, c_in, offsets, inside = elementwise_tile(M, C, BLOCK_M, BLOCK_C, C_ALIGN)
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + c, mask=c_in, other=1.0) + eps))
    normalize_tile(x, y, weight, bias, running_mean, channel_rstd, c, c_in, offsets, inside)


@triton.jit
def batch_norm2d_nhwc_partial_grad_sums(
    dy, x, mean, partials, M, C, ROWS_PER_CHUNK, ROW_STRIDE,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Training backward, split pass: per-chunk sums of dy and dy * (x - mean[c]) in fp32.

    Grid: [cdiv(C, BLOCK_C), chunks]. Program (cb, chunk) accumulates its rows lane by lane, then sums the lanes
    of each channel; writes partials[c*chunks + chunk] = its sum of dy and partials[ROW_STRIDE + c*chunks + chunk]
    = its sum of dy * (x - mean).
    """
    chunk = tl.program_id(1)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = columns_in(c, C, C_ALIGN)
    channel_mean = tl.load(mean + c, mask=c_in, other=0.0)
    first = chunk * ROWS_PER_CHUNK
    last = tl.minimum(first + ROWS_PER_CHUNK, M)
    sum_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    sum_dy_xmu = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for row0 in range(first, last, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, last, C, C_ALIGN)
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        sum_dy += dyv
        sum_dy_xmu += dyv * tl.where(inside, xv - channel_mean[None, :], 0.0)
    slot = c * tl.num_programs(1) + chunk
    tl.store(partials + slot, tl.sum(sum_dy, axis=0), mask=c_in)
    tl.store(partials + ROW_STRIDE + slot, tl.sum(sum_dy_xmu, axis=0), mask=c_in)


@triton.jit
def batch_norm2d_nhwc_merge_grad_sums(
    partials, rstd, dweight, dbias, C, NUM_PARTIALS, ROW_STRIDE,
    BLOCK_C: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
):
    """Training backward, merge pass: dbias[c] = sum of the sum_dy partials, dweight[c] = rstd[c] * sum of the
    sum_dy_xmu partials (rows 0 and 1 of `partials`), summed in BLOCK_PARTIALS-wide steps in a fixed order.

    Grid: [cdiv(C, BLOCK_C)].
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < C
    sum_dy, sum_dy_xmu = sum_partials(partials, c, c_in, NUM_PARTIALS, ROW_STRIDE, BLOCK_C, BLOCK_PARTIALS, False)
    tl.store(dbias + c, sum_dy, mask=c_in)
    tl.store(dweight + c, sum_dy_xmu * tl.load(rstd + c, mask=c_in, other=0.0), mask=c_in)


@triton.jit
def batch_norm2d_nhwc_backward_dx(
    dy, x, dx, weight, mean, rstd, dweight, dbias, M, C,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Training backward, elementwise pass, in fp32:
        dx = weight*rstd*(dy - dbias/M) - (x - mean) * weight*rstd^2 * dweight/M
    (dbias and dweight as batch_norm2d_nhwc_merge_grad_sums wrote them).

    Grid: [cdiv(C, BLOCK_C) * cdiv(M, BLOCK_M)]; program p writes the tile of `elementwise_tile`. Every dx is
    written.
    """
    c, c_in, offsets, inside = elementwise_tile(M, C, BLOCK_M, BLOCK_C, C_ALIGN)
    count = tl.cast(M, tl.float32)
    channel_rstd = tl.load(rstd + c, mask=c_in, other=0.0)
    dy_scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    dy_shift = dy_scale * tl.load(dbias + c, mask=c_in, other=0.0) / count
    xmu_scale = dy_scale * channel_rstd * tl.load(dweight + c, mask=c_in, other=0.0) / count
    channel_mean = tl.load(mean + c, mask=c_in, other=0.0)
    dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    dxv = dyv * dy_scale[None, :] - dy_shift[None, :] - (xv - channel_mean[None, :]) * xmu_scale[None, :]
    tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_nhwc_fused_forward(
    x, y, weight, bias, mean, rstd, var_unbiased, running_mean, running_var, M, C, eps, momentum,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, UPDATE_RUNNING: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Training forward in one launch, for an M that one program walks in little time.

    Grid: [cdiv(C, BLOCK_C)]. Program cb walks rows 0..M of channels cb*BLOCK_C.. BLOCK_M rows at a time, three
    times: m = sum(x - x[0, c]) / M and mean = x[0, c] + m; M2 = sum((x - x[0, c] - m)^2) (shifted, and in two
    passes, so that a mean far from zero against its spread keeps its digits); then
    y = (x - mean) * (weight * rstd) + bias with rstd = 1/sqrt(M2/M + eps). Writes mean, rstd and
    var_unbiased = M2/(M - 1); with UPDATE_RUNNING, running = (1 - momentum) * running + momentum * statistic
    (mean; var_unbiased) in place (without it the running pointers are not touched). Every y is written.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = columns_in(c, C, C_ALIGN)
    shift = tl.load(x + c, mask=c_in, other=0.0).to(tl.float32)
    lane_sum = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for row0 in range(0, M, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, M, C, C_ALIGN)
        lane_sum += tl.where(inside, tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) - shift[None, :],
                             0.0)
    count = tl.cast(M, tl.float32)
    shifted_mean = tl.sum(lane_sum, axis=0) / count
    lane_m2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for row0 in range(0, M, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, M, C, C_ALIGN)
        deviation = tl.where(inside, tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32) - shift[None, :]
                             - shifted_mean[None, :], 0.0)
        lane_m2 += deviation * deviation
    m2 = tl.sum(lane_m2, axis=0)
    batch_mean = shift + shifted_mean
    channel_rstd = store_statistics(mean, rstd, var_unbiased, running_mean, running_var, c, c_in, batch_mean, m2,
                                    count, eps, momentum, UPDATE_RUNNING)
    scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    shift = tl.load(bias + c, mask=c_in, other=0.0)
    for row0 in range(0, M, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, M, C, C_ALIGN)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        yv = (xv - batch_mean[None, :]) * scale[None, :] + shift[None, :]
        tl.store(y + offsets, yv.to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_nhwc_fused_backward(
    dy, x, dx, weight, mean, rstd, dweight, dbias, M, C,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, C_ALIGN: tl.constexpr,
):
    """Training backward in one launch, for an M that one program walks in little time.

    Grid: [cdiv(C, BLOCK_C)]. Program cb walks rows 0..M of channels cb*BLOCK_C.. BLOCK_M rows at a time, twice:
    dbias = sum(dy), dweight = rstd * sum(dy * (x - mean)), written; then
    dx = weight*rstd*(dy - dbias/M) - (x - mean) * weight*rstd^2 * dweight/M, in fp32. Every dx is written.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = columns_in(c, C, C_ALIGN)
    channel_mean = tl.load(mean + c, mask=c_in, other=0.0)
    channel_rstd = tl.load(rstd + c, mask=c_in, other=0.0)
    lane_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    lane_dy_xmu = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for row0 in range(0, M, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, M, C, C_ALIGN)
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        lane_dy += dyv
        lane_dy_xmu += dyv * tl.where(inside, xv - channel_mean[None, :], 0.0)
    sum_dy = tl.sum(lane_dy, axis=0)
    channel_dweight = tl.sum(lane_dy_xmu, axis=0) * channel_rstd
    tl.store(dbias + c, sum_dy, mask=c_in)
    tl.store(dweight + c, channel_dweight, mask=c_in)
    count = tl.cast(M, tl.float32)
    dy_scale = tl.load(weight + c, mask=c_in, other=0.0) * channel_rstd
    dy_shift = dy_scale * sum_dy / count
    xmu_scale = dy_scale * channel_rstd * channel_dweight / count
    for row0 in range(0, M, BLOCK_M):
        offsets, inside = nhwc_tile(row0 + tl.arange(0, BLOCK_M), c, M, C, C_ALIGN)
        dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        dxv = dyv * dy_scale[None, :] - dy_shift[None, :] - (xv - channel_mean[None, :]) * xmu_scale[None, :]
        tl.store(dx + offsets, dxv.to(dx.dtype.element_ty), mask=inside)


_STATS = {n: F32 for n in ("weight", "bias", "mean", "rstd", "var_unbiased", "dweight", "dbias", "running_mean",
                           "running_var", "partials")}
_TILE = (nhwc_tile, columns_in, nhwc_row)
_ELEMENTWISE = (elementwise_tile,) + _TILE
_NORMALIZING = _ELEMENTWISE + (normalize_tile,)

BatchNorm2dNhwcPartialStats = kernel_object(
    batch_norm2d_nhwc_partial_stats, entry=split_entry(3), example=(32, 64, 8), pointer_dtypes=_STATS,
    helpers=_TILE)
BatchNorm2dNhwcMergeStats = kernel_object(
    batch_norm2d_nhwc_merge_stats, entry=merge_entry(3), example=(32, 64, True), floats=("eps", "momentum"),
    pointer_dtypes=_STATS, flags=("UPDATE_RUNNING",),
    helpers=(partial_slots, sum_partials, store_statistics, update_running_statistics))
BatchNorm2dNhwcNormalize = kernel_object(
    batch_norm2d_nhwc_normalize, entry=elementwise_entry, example=(32, 64, 8), pointer_dtypes=_STATS,
    helpers=_NORMALIZING)
BatchNorm2dNhwcEvalForward = kernel_object(
    batch_norm2d_nhwc_eval_forward, entry=elementwise_entry, example=(32, 64, 8), floats=("eps",),
    pointer_dtypes=_STATS, helpers=_NORMALIZING)
BatchNorm2dNhwcPartialGradSums = kernel_object(
    batch_norm2d_nhwc_partial_grad_sums, entry=split_entry(2), example=(32, 64, 8), pointer_dtypes=_STATS,
    helpers=_TILE)
BatchNorm2dNhwcMergeGradSums = kernel_object(
    batch_norm2d_nhwc_merge_grad_sums, entry=merge_entry(2), example=(64, 64), pointer_dtypes=_STATS,
    helpers=(partial_slots, sum_partials))
BatchNorm2dNhwcBackwardDx = kernel_object(
    batch_norm2d_nhwc_backward_dx, entry=elementwise_entry, example=(32, 64, 8), pointer_dtypes=_STATS,
    helpers=_ELEMENTWISE)
BatchNorm2dNhwcFusedForward = kernel_object(
    batch_norm2d_nhwc_fused_forward, entry=fused_entry, example=(32, 64, True, 8), floats=("eps", "momentum"),
    pointer_dtypes=_STATS, flags=("UPDATE_RUNNING",), helpers=_TILE + (store_statistics, update_running_statistics))
BatchNorm2dNhwcFusedBackward = kernel_object(
    batch_norm2d_nhwc_fused_backward, entry=fused_entry, example=(32, 64, 8), pointer_dtypes=_STATS,
    helpers=_TILE)
