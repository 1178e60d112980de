"""How batch norm's passes cut their work (`ops/batch_norm/`), with the configs tuning chooses among, and the
runners a plan calls.

A [B, C, HW] problem whose channel fits one tile takes the grouped kernels: several whole channels per program
(`GroupedConfig`: the tile, the channels per program, the warps). Larger channels take the split kernels: each
channel's tiles cut into chunks, per-chunk partials, then a second pass (`SplitConfig`: elements per tile,
programs aimed at, warps). Which of the two runs is a rule (`fits_one_tile`); within each, tuning picks.
A channels-last 4-D input (`BatchNormProblem.nhwc`) takes the channels-last kernels of `batchnorm_nhwc` instead,
in training and in the evaluation forward: its candidates here, its passes there (the plan picks the module).
"""
from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import torch

from ..launcher import Launcher
from ..ops.batch_norm.eval import (BatchNorm2dEvalBackward, BatchNorm2dEvalBackwardGrouped, BatchNorm2dEvalForward,
                                   BatchNorm2dEvalForwardGrouped, BatchNorm2dSumPartials)
from ..ops.batch_norm.train import (BatchNorm2dPartialGradSums, BatchNorm2dPartialStats, BatchNorm2dTrainBackwardDx,
                                    BatchNorm2dTrainBackwardFused, BatchNorm2dTrainForwardFused,
                                    BatchNorm2dTrainNormalize)
from ..ops.common.host_math import cdiv, next_power_of_2
from . import batchnorm_nhwc as nhwc
from .common import allocator, fp32_rows_length, kernel, stored_config

F32 = torch.float32
# How one launch cuts the work: split plans use block_b, block_hw and the chunk fields; grouped plans use
# channels (per program), block_c, block_b, block_j and vector.
TilePlan = namedtuple("TilePlan", "channels block_c block_b block_hw block_j vector tiles_per_chunk num_chunks "
                                  "block_partials fused")

# The split passes on the GPU: about this many elements per tile, and 16 programs per SM (several waves).
GPU_TILE = 2048
PROGRAMS_PER_SM = 16
# A channel fits one grouped tile up to this many elements; grouped tiles hold about GROUPED_TILE (32 per thread
# at 8 warps), in at least two programs per SM.
FUSED_LIMIT = 8192
GROUPED_TILE = 8192
GROUPED_PROGRAMS_PER_SM = 2
# The interpreter pays per program and per operation, not per element: few, large tiles.
CPU_TILE = 2**16


@dataclass(frozen=True)
class GroupedConfig:
    """A grouped launch: tiles of block_b images x block_j columns holding `channels` channels, `num_warps`."""

    block_b: int
    block_j: int
    channels: int
    num_warps: int


@dataclass(frozen=True)
class SplitConfig:
    """The split passes: tiles of about `tile` elements, aiming at `programs` programs, `num_warps` warps."""

    tile: int
    programs: int
    num_warps: int


def _block_hw(HW, tile):
    """The widest power-of-two row (<= tile) that wastes at most 10% of its lanes over HW."""
    widest = min(next_power_of_2(HW), tile)
    for width in (widest >> i for i in range(widest.bit_length())):
        if width >= 16 and HW / (cdiv(HW, width) * width) >= 0.9:
            return width
    return widest


def group_vector(C, HW, channels, element_size):
    """Elements (a power of two, at most 16 bytes) dividing every row start and length of a grouped tile: both are
    multiples of HW * gcd(C, channels)."""
    run = HW * math.gcd(C, channels)
    return min(run & -run, max(1, 16 // element_size))


def fused_channels(B, C, HW, element_size, tile, min_programs, vector_bytes=8):
    """Channels per grouped program: the most lanes used, in the widest aligned vectors (up to `vector_bytes` count
    fully), ties to more channels; within `tile` elements and `min_programs` programs."""
    block_b = next_power_of_2(B)
    most = max(1, min(C, tile // (block_b * HW), C // min_programs))

    def merit(k):
        used = k * HW / next_power_of_2(k * HW)
        return used * min(group_vector(C, HW, k, element_size) * element_size, vector_bytes) / vector_bytes, k

    return max(range(1, most + 1), key=merit)


def grouped_plan(B, C, HW, channels, element_size):
    """The grouped plan with `channels` channels per program: a [next_pow2(B), next_pow2(channels*HW)] tile,
    BLOCK_C = next_pow2(channels) and the widest vector that divides its rows (`group_vector`)."""
    return TilePlan(channels, next_power_of_2(channels), next_power_of_2(B), 0, next_power_of_2(channels * HW),
                    group_vector(C, HW, channels, element_size), 1, 1, 1, True)


def fits_one_tile(B, HW, machine, fused_limit=None):
    limit = fused_limit if fused_limit is not None else FUSED_LIMIT if machine.gpu else CPU_TILE
    return next_power_of_2(B) * next_power_of_2(HW) <= limit


def tile_plan(B, C, HW, machine, *, element_size=4, tile=None, programs=None, fused_limit=None, channels=None):
    """Tile shape and split of one [B, C, HW] problem on `machine` (keywords override the first guesses;
    `channels` the channels per grouped program)."""
    if fits_one_tile(B, HW, machine, fused_limit):
        # The interpreter: as many channels as one tile holds; the GPU: a few, so that programs fill it.
        channels = channels or (
            fused_channels(B, C, HW, element_size, GROUPED_TILE, GROUPED_PROGRAMS_PER_SM * machine.sms) if machine.gpu
            else max(1, min(C, CPU_TILE // (next_power_of_2(B) * HW))))
        return grouped_plan(B, C, HW, channels, element_size)
    tile = tile or (GPU_TILE if machine.gpu else CPU_TILE)
    programs = programs or (PROGRAMS_PER_SM * machine.sms if machine.gpu else 1)
    block_hw = _block_hw(HW, tile)
    block_b = max(1, min(tile // block_hw, next_power_of_2(B)))
    num_tiles = cdiv(B, block_b) * cdiv(HW, block_hw)
    chunks = max(1, min(cdiv(programs, C), num_tiles, 1024))
    tiles_per_chunk = cdiv(num_tiles, chunks)
    chunks = cdiv(num_tiles, tiles_per_chunk)
    return TilePlan(1, 1, block_b, block_hw, 0, 1, tiles_per_chunk, chunks, next_power_of_2(chunks), False)


# Grouped candidates after the first guess, most promising first: (elements per tile, num_warps). Smaller tiles
# mean more programs, whose loads, reductions and stores overlap; larger ones load longer rows in wider vectors.
GROUPED_SHAPES = ((8192, 8), (4096, 4), (16384, 8), (8192, 4), (4096, 8), (16384, 4), (2048, 4))
# The training forward holds one tile (x) per program where a backward holds two (dy, x): it also runs fast at
# 1 and 2 warps, which go first for it.
GROUPED_FORWARD_SHAPES = ((4096, 1), (8192, 2))
ELEMENTS_PER_WARP = 128  # at least 4 elements per thread
MOST_ELEMENTS_PER_THREAD = 128  # so that the registers hold a tile that rounds up (14x14 -> 256 columns)
MOST_GROUPED_CANDIDATES = 6


def grouped_candidates(B, C, HW, element_size, machine, *, step="", shapes=None) -> list[GroupedConfig]:
    """Configs of a grouped launch of `step`: first the plan's own guess (8 warps), then per (tile, num_warps) of
    `shapes` (GROUPED_SHAPES, after GROUPED_FORWARD_SHAPES for "train_forward") the channels per program that
    `fused_channels` fits in about `tile` elements with at least one program per SM, preferring 16-byte rows;
    num_warps at most one per ELEMENTS_PER_WARP elements and at least one per 32 * MOST_ELEMENTS_PER_THREAD;
    duplicates dropped, at most MOST_GROUPED_CANDIDATES. The vector width follows from the channels."""
    def config(channels, num_warps):
        plan = grouped_plan(B, C, HW, channels, element_size)
        elements = plan.block_b * plan.block_j
        num_warps = max(1, min(num_warps, elements // ELEMENTS_PER_WARP), elements // (32 * MOST_ELEMENTS_PER_THREAD))
        return GroupedConfig(plan.block_b, plan.block_j, channels, num_warps)

    configs = [config(tile_plan(B, C, HW, machine, element_size=element_size).channels, 8)]
    if not machine.gpu:
        return configs
    if shapes is None:
        shapes = (GROUPED_FORWARD_SHAPES if step == "train_forward" else ()) + GROUPED_SHAPES
    configs += [config(fused_channels(B, C, HW, element_size, tile, machine.sms, vector_bytes=16), num_warps)
                for tile, num_warps in shapes]
    return list(dict.fromkeys(configs))[:MOST_GROUPED_CANDIDATES]


# Split candidates, the first guess first: (elements per tile, programs per SM aimed at, num_warps).
SPLIT_SHAPES = {
    "train_forward": ((GPU_TILE, PROGRAMS_PER_SM, 4), (8192, 2 * PROGRAMS_PER_SM, 4), (4096, 2 * PROGRAMS_PER_SM, 4),
                      (2048, 2 * PROGRAMS_PER_SM, 4), (8192, PROGRAMS_PER_SM, 4)),
    "train_backward": ((GPU_TILE, PROGRAMS_PER_SM, 4), (2048, 2 * PROGRAMS_PER_SM, 4), (8192, 2 * PROGRAMS_PER_SM, 4),
                       (4096, 2 * PROGRAMS_PER_SM, 8), (8192, PROGRAMS_PER_SM, 4)),
}


def split_candidates(step, machine) -> list[SplitConfig]:
    """Configs of a split training pass (`step` "train_forward" or "train_backward"); the interpreter's one: few,
    large tiles."""
    if not machine.gpu:
        return [SplitConfig(CPU_TILE, 1, 4)]
    return [SplitConfig(tile, per_sm * machine.sms, warps) for tile, per_sm, warps in SPLIT_SHAPES[step]]


def _grouped_kernel(cls, dtype, plan, num_warps, more_constants=()):
    constants = (plan.block_b, plan.block_j, plan.vector, *more_constants)
    if "BLOCK_C" in cls.constant_names:
        constants = (plan.block_c, *constants)
    return kernel(cls, *constants, dtype=dtype, num_warps=num_warps)


def _split_plan(problem, config):
    B, C, HW = problem.dims
    return tile_plan(B, C, HW, problem.machine, element_size=problem.element_size, tile=config.tile,
                     programs=config.programs, fused_limit=0)


def _grouped(problem, config):
    B, C, HW = problem.dims
    return grouped_plan(B, C, HW, config.channels, problem.element_size)


# ---- runners: what one call of a pass launches, for one config ----

def train_forward_kernels(problem, config, update_running):
    if problem.fused:
        return [_grouped_kernel(BatchNorm2dTrainForwardFused, problem.dtype, _grouped(problem, config),
                                config.num_warps, (update_running,))]
    plan = _split_plan(problem, config)
    return [kernel(BatchNorm2dPartialStats, plan.block_b, plan.block_hw, dtype=problem.dtype,
                   num_warps=config.num_warps),
            kernel(BatchNorm2dTrainNormalize, plan.block_b, plan.block_hw, plan.block_partials, update_running,
                   dtype=problem.dtype, num_warps=config.num_warps)]


def train_forward_runner(problem, config, update_running):
    """run(x, weight, bias, running_mean, running_var, eps, momentum) -> (y, mean, rstd, var_unbiased), updating the
    running statistics in place when `update_running` (in the grouped kernel's one pass, in the split's second).
    weight and bias are fp32."""
    B, C, HW = problem.dims
    launches = [Launcher(k) for k in train_forward_kernels(problem, config, update_running)]
    shape, new, new_f32 = problem.shape, allocator(problem.dtype, problem.device), allocator(F32, problem.device)
    if problem.fused:
        fused = launches[0]
        channels = config.channels

        def run(x, weight, bias, running_mean, running_var, eps, momentum):
            y = new(*shape)
            mean, rstd, var_unbiased = (new_f32(C) for _ in range(3))
            # Without running statistics the kernel never reads its running pointers: mean and var_unbiased stand in.
            old = (running_mean, running_var) if update_running else (mean, var_unbiased)
            fused(x, y, weight, bias, mean, rstd, var_unbiased, *old, *old, B, C, HW, channels, eps, momentum)
            return y, mean, rstd, var_unbiased

        return run
    plan = _split_plan(problem, config)
    stats, normalize = launches
    chunks, tiles_per_chunk = plan.num_chunks, plan.tiles_per_chunk
    row = fp32_rows_length(C * chunks)  # count, mean and M2 rows in one buffer

    def run_split(x, weight, bias, running_mean, running_var, eps, momentum):
        partials = new_f32(3 * row)
        stats(x, partials, B, C, HW, tiles_per_chunk, row)
        y = new(*shape)
        mean, rstd, var_unbiased = (new_f32(C) for _ in range(3))
        # Without running statistics the kernel never reads its running pointers: mean and var_unbiased stand in.
        old = (running_mean, running_var) if update_running else (mean, var_unbiased)
        normalize(x, y, weight, bias, partials, mean, rstd, var_unbiased, *old, B, C, HW, chunks, tiles_per_chunk,
                  row, eps, momentum)
        return y, mean, rstd, var_unbiased

    return run_split


def train_backward_kernels(problem, config):
    if problem.fused:
        return [_grouped_kernel(BatchNorm2dTrainBackwardFused, problem.dtype, _grouped(problem, config),
                                config.num_warps)]
    plan = _split_plan(problem, config)
    return [kernel(BatchNorm2dPartialGradSums, plan.block_b, plan.block_hw, dtype=problem.dtype,
                   num_warps=config.num_warps),
            kernel(BatchNorm2dTrainBackwardDx, plan.block_b, plan.block_hw, plan.block_partials, dtype=problem.dtype,
                   num_warps=config.num_warps)]


def train_backward_runner(problem, config):
    """run(dy, x, weight, mean, rstd) -> (dx, dweight, dbias), the parameter gradients in fp32."""
    B, C, HW = problem.dims
    launches = [Launcher(k) for k in train_backward_kernels(problem, config)]
    shape, new, new_f32 = problem.shape, allocator(problem.dtype, problem.device), allocator(F32, problem.device)
    if problem.fused:
        fused, channels = launches[0], config.channels

        def run(dy, x, weight, mean, rstd):
            dx = new(*shape)
            dweight, dbias = new_f32(C), new_f32(C)
            fused(dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, channels)
            return dx, dweight, dbias

        return run
    plan = _split_plan(problem, config)
    sums, dx_pass = launches
    chunks, tiles_per_chunk = plan.num_chunks, plan.tiles_per_chunk
    row = fp32_rows_length(C * chunks)  # sum_dy and sum_dy_xmu rows in one buffer

    def run_split(dy, x, weight, mean, rstd):
        partials = new_f32(2 * row)
        sums(dy, x, mean, partials, B, C, HW, tiles_per_chunk, row)
        dx = new(*shape)
        dweight, dbias = new_f32(C), new_f32(C)
        dx_pass(dy, x, dx, weight, mean, rstd, partials, dweight, dbias, B, C, HW, chunks, tiles_per_chunk, row)
        return dx, dweight, dbias

    return run_split


def _eval_plan(problem):
    B, C, HW = problem.dims
    return tile_plan(B, C, HW, problem.machine, element_size=problem.element_size)


def eval_forward_kernels(problem, config):
    if problem.fused:
        return [_grouped_kernel(BatchNorm2dEvalForwardGrouped, problem.dtype, _grouped(problem, config),
                                config.num_warps)]
    plan = _eval_plan(problem)
    return [kernel(BatchNorm2dEvalForward, plan.block_b, plan.block_hw, dtype=problem.dtype)]


def eval_forward_runner(problem, config):
    """run(x, weight, bias, running_mean, running_var, eps) -> y."""
    B, C, HW = problem.dims
    launch = Launcher(eval_forward_kernels(problem, config)[0])
    shape, new = problem.shape, allocator(problem.dtype, problem.device)
    last = config.channels if problem.fused else _eval_plan(problem).tiles_per_chunk  # CHANNELS or TILES_PER_CHUNK

    def run(x, weight, bias, running_mean, running_var, eps):
        y = new(*shape)
        launch(x, y, weight, bias, running_mean, running_var, B, C, HW, last, eps)
        return y

    return run


def eval_backward_kernels(problem, config):
    if problem.fused:
        return [_grouped_kernel(BatchNorm2dEvalBackwardGrouped, problem.dtype, _grouped(problem, config),
                                config.num_warps)]
    plan = _eval_plan(problem)
    kernels = [kernel(BatchNorm2dEvalBackward, plan.block_b, plan.block_hw, dtype=problem.dtype)]
    if plan.num_chunks > 1:
        kernels.append(kernel(BatchNorm2dSumPartials, max(1, 4096 // plan.block_partials), plan.block_partials,
                              dtype=problem.dtype))
    return kernels


def eval_backward_runner(problem, config):
    """run(dy, x, weight, running_mean, running_var, eps) -> (dx, dweight, dbias), the parameter gradients in fp32."""
    B, C, HW = problem.dims
    launches = [Launcher(k) for k in eval_backward_kernels(problem, config)]
    shape, new, new_f32 = problem.shape, allocator(problem.dtype, problem.device), allocator(F32, problem.device)
    if problem.fused:
        per_program, chunks = config.channels, 1  # the grouped kernel takes CHANNELS and writes whole sums
    else:
        plan = _eval_plan(problem)
        per_program, chunks = plan.tiles_per_chunk, plan.num_chunks  # the split one TILES_PER_CHUNK
    backward, total = launches[0], launches[1] if chunks > 1 else None

    def run(dy, x, weight, running_mean, running_var, eps):
        dx = new(*shape)
        dweight, dbias = new_f32(C), new_f32(C)
        if total is None:
            backward(dy, x, dx, weight, running_mean, running_var, dweight, dbias, B, C, HW, per_program, eps)
            return dx, dweight, dbias
        partial_dweight = new_f32(C * chunks)
        partial_dbias = new_f32(C * chunks)
        backward(dy, x, dx, weight, running_mean, running_var, partial_dweight, partial_dbias, B, C, HW,
                 per_program, eps)
        total(partial_dweight, partial_dbias, dweight, dbias, C, chunks)
        return dx, dweight, dbias

    return run


class BatchNormProblem:
    """A batch norm's sizes, x viewed as [B, C, HW] (any input of 2 or more dimensions, as torch takes it), on
    `device`; `nhwc` whether x is a channels-last 4-D tensor that the channels-last kernels read where it lies
    (training and the evaluation forward), `fused` whether a channel fits one grouped tile (NCHW only)."""

    def __init__(self, shape, dtype, device, machine, nhwc=False):
        B, C = shape[0], shape[1]
        self.shape, self.dtype, self.device, self.machine, self.nhwc = tuple(shape), dtype, device, machine, nhwc
        self.dims = (B, C, math.prod(shape) // (B * C) if B * C else 0)
        self.rows = B * self.dims[2]
        self.element_size = dtype.itemsize
        self.fused = not nhwc and fits_one_tile(B, self.dims[2], machine)
        self.key = (*self.dims, str(dtype)) + (("nhwc",) if nhwc else ())

    def candidates(self, step):
        """The configs tuning chooses among for `step`, and how a stored one is read back."""
        if self.nhwc:
            if step in SPLIT_SHAPES:
                return (lambda: nhwc.nhwc_candidates(self.dims[1], self.machine, self.rows)), stored_config(nhwc.NhwcConfig)
            return (lambda: [None]), None  # the evaluation forward: one elementwise launch
        if self.fused:
            grouped = lambda: grouped_candidates(*self.dims, self.element_size, self.machine, step=step)  # noqa: E731
            return grouped, stored_config(GroupedConfig)
        if step in SPLIT_SHAPES:
            return (lambda: split_candidates(step, self.machine)), stored_config(SplitConfig)
        return (lambda: [None]), None  # the split evaluation passes: one plan, nothing to tune

    def kind(self, step):
        return f"batch_norm_{step}_{'nhwc' if self.nhwc else 'grouped' if self.fused else 'split'}"


# ---- runners of the synchronised training passes (`sync_batchnorm`): the split kernels with the partials
# exchanged between them, whatever the size of a channel ----


def sync_statistics_kernels(problem, config):
    plan = _split_plan(problem, config)
    return [kernel(BatchNorm2dPartialStats, plan.block_b, plan.block_hw, dtype=problem.dtype,
                   num_warps=config.num_warps)]


def sync_statistics_runner(problem, config):
    """(run(x, partials), chunks): run writes x's per-chunk count, mean (of x - x[0, c, 0]) and M2 into rows 0, 1 and
    2 of `partials`, fp32 [3 or more, >= C*chunks] with contiguous rows, as [C, chunks] each
    (BatchNorm2dPartialStats)."""
    B, C, HW = problem.dims
    plan = _split_plan(problem, config)
    stats = Launcher(sync_statistics_kernels(problem, config)[0])
    tiles_per_chunk = plan.tiles_per_chunk

    def run(x, partials):
        stats(x, partials, B, C, HW, tiles_per_chunk, partials.stride(0))

    return run, plan.num_chunks


def sync_backward_kernels(problem, config):
    plan = _split_plan(problem, config)
    kernels = [kernel(BatchNorm2dPartialGradSums, plan.block_b, plan.block_hw, dtype=problem.dtype,
                      num_warps=config.num_warps),
               kernel(BatchNorm2dTrainBackwardDx, plan.block_b, plan.block_hw, 1, dtype=problem.dtype,
                      num_warps=config.num_warps)]
    if plan.num_chunks > 1:
        kernels.append(kernel(BatchNorm2dSumPartials, max(1, 4096 // plan.block_partials), plan.block_partials,
                              dtype=problem.dtype))
    return kernels


def sync_backward_runners(problem, config):
    """(sums(dy, x, mean, local), dx(dy, x, weight, mean, rstd, totals) -> dx).

    sums writes this rank's per-channel sum of dy into local[0, :C] and of dy * (x - mean) into local[1, :C]
    (fp32 [2, >= C] with contiguous rows; partials per chunk summed in a fixed order). dx takes the sums over
    every rank in `totals` (laid out as `local`), each already scaled by
    B*HW / N (N the count over every rank): BatchNorm2dTrainBackwardDx, given them as one partial per channel,
    divides by this rank's own count B*HW, so it divides by N. Its dweight and dbias go to scratch."""
    B, C, HW = problem.dims
    plan = _split_plan(problem, config)
    launches = [Launcher(k) for k in sync_backward_kernels(problem, config)]
    sums, dx_pass = launches[:2]
    total = launches[2] if plan.num_chunks > 1 else None
    chunks, tiles_per_chunk = plan.num_chunks, plan.tiles_per_chunk
    shape, dtype, device = problem.shape, problem.dtype, problem.device
    scratch = torch.empty(2, fp32_rows_length(C), dtype=F32, device=device)  # written by dx_pass, never read
    row = fp32_rows_length(C * chunks)

    def run_sums(dy, x, mean, local):
        if total is None:
            sums(dy, x, mean, local, B, C, HW, tiles_per_chunk, local.stride(0))
            return
        partial = torch.empty(2, row, dtype=F32, device=device)
        sums(dy, x, mean, partial, B, C, HW, tiles_per_chunk, row)
        total(partial[1, :C * chunks], partial[0, :C * chunks], local[1, :C], local[0, :C], C, chunks)

    def run_dx(dy, x, weight, mean, rstd, totals):
        dx = torch.empty(shape, dtype=dtype, device=device)
        dx_pass(dy, x, dx, weight, mean, rstd, totals, scratch[1, :C], scratch[0, :C], B, C, HW, 1, tiles_per_chunk,
                totals.stride(0))
        return dx

    return run_sums, run_dx
