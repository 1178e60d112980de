"""Batch norm of a channels-last 4-D input on its own layout (`ops/batch_norm/channels_last.py`): the passes'
configs, the kernels a config makes and the runners a plan calls.

A training pass is three launches: a split pass over chunks of rows, a merge of each channel's partials, an
elementwise pass. `NhwcConfig` sets the split pass's tile (block_m rows by block_c channels), the programs it
aims at (so that a few channels of a large batch still fill the GPU) and its warps; the other two passes
follow from it. Up to FUSED_ROWS rows a `fused` config makes it one launch, whose programs each walk every row
of block_c channels: fewer launches for the host to issue, tuned against the split passes. The evaluation
forward is one elementwise launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launcher import Launcher
from ..ops.batch_norm.channels_last import (BatchNorm2dNhwcBackwardDx, BatchNorm2dNhwcEvalForward,
                                            BatchNorm2dNhwcFusedBackward, BatchNorm2dNhwcFusedForward,
                                            BatchNorm2dNhwcMergeGradSums, BatchNorm2dNhwcMergeStats,
                                            BatchNorm2dNhwcNormalize, BatchNorm2dNhwcPartialGradSums,
                                            BatchNorm2dNhwcPartialStats)
from ..ops.common.host_math import cdiv, channel_alignment, next_power_of_2
from .common import allocator, channels_last_allocator, fp32_rows_length, kernel

F32 = torch.float32
# Programs of the split passes per SM aimed at; the elementwise passes' tiles hold about this many elements.
PROGRAMS_PER_SM = 8
ELEMENTWISE_TILE = 4096
MERGE_CHANNELS = 8
MERGE_PARTIALS = 256
# The interpreter pays per program and per operation: few, large tiles.
CPU_TILE = 2**15
# A fused pass walks its rows three times in one program: up to this many (B64 7x7 planes are 3136).
FUSED_ROWS = 4096


@dataclass(frozen=True)
class NhwcConfig:
    """The split pass's tile (`block_m` rows by `block_c` channels), the programs it aims at, `num_warps`; or,
    `fused`, the one launch's step (block_m rows) over cdiv(C, block_c) programs (`programs` unused)."""

    block_m: int
    block_c: int
    programs: int
    num_warps: int
    fused: bool = False


# Split-pass candidates, the first guess first: (channels per tile, elements per tile, programs per SM, warps).
# Rows of 64 bf16 or fp32 channels are 128 or 256 contiguous bytes; narrower tiles give small C more programs.
NHWC_SHAPES = ((64, 2048, PROGRAMS_PER_SM, 4), (32, 2048, PROGRAMS_PER_SM, 4), (128, 4096, PROGRAMS_PER_SM, 8),
               (64, 4096, 2 * PROGRAMS_PER_SM, 8), (16, 1024, 2 * PROGRAMS_PER_SM, 4))
# Fused candidates, first when M <= FUSED_ROWS: (channels per program, elements per step, warps). Narrow channel
# blocks give more programs, which a small M needs to fill the GPU.
FUSED_SHAPES = ((16, 2048, 4), (32, 2048, 4), (8, 1024, 4))


def nhwc_candidates(C, machine, rows) -> list[NhwcConfig]:
    """Configs of a channels-last training pass of `rows` rows (M) on `machine`: channel blocks no wider than C's
    power of two; the fused ones first where M <= FUSED_ROWS."""
    widest = next_power_of_2(C)
    fused = rows <= FUSED_ROWS
    if not machine.gpu:
        block_c = min(widest, 64)
        return [NhwcConfig(max(1, CPU_TILE // block_c), block_c, 1, 4, fused)]
    configs = []
    if fused:
        for block_c, tile, warps in FUSED_SHAPES:
            block_c = min(block_c, widest)
            configs.append(NhwcConfig(max(1, tile // block_c), block_c, 0, warps, True))
    for block_c, tile, per_sm, warps in NHWC_SHAPES:
        block_c = min(block_c, widest)
        configs.append(NhwcConfig(max(1, tile // block_c), block_c, per_sm * machine.sms, warps))
    return list(dict.fromkeys(configs))


def _split(M, C, config):
    """(rows per chunk, chunks): chunks of whole tiles, as many as bring the programs near `config.programs`."""
    tiles = cdiv(M, config.block_m)
    chunks = max(1, min(cdiv(config.programs, cdiv(C, config.block_c)), tiles, 65535))
    rows_per_chunk = cdiv(tiles, chunks) * config.block_m
    return rows_per_chunk, cdiv(M, rows_per_chunk)


def _elementwise(C, config, machine):
    """(block_m, block_c) of an elementwise pass: the split pass's channels, about ELEMENTWISE_TILE elements."""
    tile = ELEMENTWISE_TILE if machine.gpu else CPU_TILE
    return max(1, tile // config.block_c), config.block_c


def _merge_partials(chunks):
    return min(MERGE_PARTIALS, next_power_of_2(chunks))


def _alignment(problem):
    """C_ALIGN of the kernels that read [M, C] tiles (`host_math.channel_alignment`)."""
    return channel_alignment(problem.dims[1], problem.dtype.itemsize)


def train_forward_kernels(problem, config, update_running):
    M, C = problem.rows, problem.dims[1]
    align = _alignment(problem)
    if config.fused:
        return [kernel(BatchNorm2dNhwcFusedForward, config.block_m, config.block_c, update_running, align,
                       dtype=problem.dtype, num_warps=config.num_warps)]
    chunks = _split(M, C, config)[1]
    return [kernel(BatchNorm2dNhwcPartialStats, config.block_m, config.block_c, align, dtype=problem.dtype,
                   num_warps=config.num_warps),
            kernel(BatchNorm2dNhwcMergeStats, MERGE_CHANNELS, _merge_partials(chunks), update_running,
                   dtype=problem.dtype),
            kernel(BatchNorm2dNhwcNormalize, *_elementwise(C, config, problem.machine), align, dtype=problem.dtype)]


def train_forward_runner(problem, config, update_running):
    """run(x, weight, bias, running_mean, running_var, eps, momentum) -> (y, mean, rstd, var_unbiased); x and y
    channels-last [B, C, H, W] tensors (the kernels get their NHWC views), the running statistics updated in
    place when `update_running`."""
    M, C = problem.rows, problem.dims[1]
    launches = [Launcher(k) for k in train_forward_kernels(problem, config, update_running)]
    new, new_f32 = channels_last_allocator(problem.dtype, problem.device), allocator(F32, problem.device)
    shape = problem.shape
    if config.fused:
        fused = launches[0]

        def run_fused(x, weight, bias, running_mean, running_var, eps, momentum):
            y = new(*shape)
            mean, rstd, var_unbiased = (new_f32(C) for _ in range(3))
            running = (running_mean, running_var) if update_running else (mean, var_unbiased)
            fused(x.permute(0, 2, 3, 1), y.permute(0, 2, 3, 1), weight, bias, mean, rstd, var_unbiased, *running, M,
                  C, eps, momentum)
            return y, mean, rstd, var_unbiased

        return run_fused
    stats, merge, normalize = launches
    rows_per_chunk, chunks = _split(M, C, config)
    row = fp32_rows_length(C * chunks)  # count, mean and M2 rows in one buffer

    def run(x, weight, bias, running_mean, running_var, eps, momentum):
        partials, x = new_f32(3 * row), x.permute(0, 2, 3, 1)
        stats(x, partials, M, C, rows_per_chunk, row)
        mean, rstd, var_unbiased = (new_f32(C) for _ in range(3))
        # Without running statistics the kernel never reads its running pointers: mean and var_unbiased stand in.
        running = (running_mean, running_var) if update_running else (mean, var_unbiased)
        merge(x, partials, mean, rstd, var_unbiased, *running, C, chunks, row, eps, momentum)
        y = new(*shape)
        normalize(x, y.permute(0, 2, 3, 1), weight, bias, mean, rstd, M, C)
        return y, mean, rstd, var_unbiased

    return run


def train_backward_kernels(problem, config):
    M, C = problem.rows, problem.dims[1]
    align = _alignment(problem)
    if config.fused:
        return [kernel(BatchNorm2dNhwcFusedBackward, config.block_m, config.block_c, align, dtype=problem.dtype,
                       num_warps=config.num_warps)]
    chunks = _split(M, C, config)[1]
    return [kernel(BatchNorm2dNhwcPartialGradSums, config.block_m, config.block_c, align, dtype=problem.dtype,
                   num_warps=config.num_warps),
            kernel(BatchNorm2dNhwcMergeGradSums, MERGE_CHANNELS, _merge_partials(chunks), dtype=problem.dtype),
            kernel(BatchNorm2dNhwcBackwardDx, *_elementwise(C, config, problem.machine), align,
                   dtype=problem.dtype)]


def train_backward_runner(problem, config):
    """run(dy, x, weight, mean, rstd) -> (dx, dweight, dbias): dy, x and dx channels-last, the parameter
    gradients fp32."""
    M, C = problem.rows, problem.dims[1]
    launches = [Launcher(k) for k in train_backward_kernels(problem, config)]
    new, new_f32 = channels_last_allocator(problem.dtype, problem.device), allocator(F32, problem.device)
    shape = problem.shape
    if config.fused:
        fused = launches[0]

        def run_fused(dy, x, weight, mean, rstd):
            dx = new(*shape)
            dweight, dbias = new_f32(C), new_f32(C)
            fused(dy.permute(0, 2, 3, 1), x.permute(0, 2, 3, 1), dx.permute(0, 2, 3, 1), weight, mean, rstd, dweight,
                  dbias, M, C)
            return dx, dweight, dbias

        return run_fused
    sums, merge, dx_pass = launches
    rows_per_chunk, chunks = _split(M, C, config)
    row = fp32_rows_length(C * chunks)  # sum_dy and sum_dy_xmu rows in one buffer

    def run(dy, x, weight, mean, rstd):
        partials, dy, x = new_f32(2 * row), dy.permute(0, 2, 3, 1), x.permute(0, 2, 3, 1)
        sums(dy, x, mean, partials, M, C, rows_per_chunk, row)
        dweight, dbias = new_f32(C), new_f32(C)
        merge(partials, rstd, dweight, dbias, C, chunks, row)
        dx = new(*shape)
        dx_pass(dy, x, dx.permute(0, 2, 3, 1), weight, mean, rstd, dweight, dbias, M, C)
        return dx, dweight, dbias

    return run


def eval_forward_kernels(problem, config):
    split_guess = nhwc_candidates(problem.dims[1], problem.machine, FUSED_ROWS + 1)[0]
    block_m, block_c = _elementwise(problem.dims[1], split_guess, problem.machine)
    return [kernel(BatchNorm2dNhwcEvalForward, block_m, block_c, _alignment(problem), dtype=problem.dtype)]


def eval_forward_runner(problem, config):
    """run(x, weight, bias, running_mean, running_var, eps) -> y, x and y channels-last."""
    M, C = problem.rows, problem.dims[1]
    launch = Launcher(eval_forward_kernels(problem, config)[0])
    new, shape = channels_last_allocator(problem.dtype, problem.device), problem.shape

    def run(x, weight, bias, running_mean, running_var, eps):
        y = new(*shape)
        launch(x.permute(0, 2, 3, 1), y.permute(0, 2, 3, 1), weight, bias, running_mean, running_var, M, C, eps)
        return y

    return run
