"""`batch_norm`: `torch.nn.functional.batch_norm` on nnkernels' kernels, with autograd.

Custom operators (each with a fake implementation, so `torch.compile(fullgraph=True)` traces them):
- `nnkernels::batch_norm_train(x, weight, bias, eps) -> (y, mean, rstd, var_unbiased)`, with autograd
  through `nnkernels::batch_norm_train_backward` (training without running statistics);
- `nnkernels::batch_norm_train_update(x, weight, bias, running_mean!, running_var!, momentum, eps)
  -> (y, mean, rstd)`, which also updates the running statistics in place (in the kernel that takes the
  statistics, where a channel fits one tile). PyTorch accepts autograd formulas only on functional
  operators, so its autograd is a `torch.autograd.Function` (`_TrainUpdatingRunningStats`), with the same
  backward op;
- `nnkernels::batch_norm_eval(x, running_mean, running_var, weight, bias, eps) -> y`, with autograd
  through `nnkernels::batch_norm_eval_backward`.
`last_kernels()` names the kernel objects the latest calls launched.

Channels that fit one tile take the grouped kernels (several channels per program); their channels per
program and num_warps are timed on the GPU per shape by `nnkernels.tuning.choose` over
`grouped_candidates`, and remembered; the split training passes' tile, programs and num_warps likewise over
`split_candidates`. The tuned kernels are pure (each call rewrites all its outputs), so tuning may run them
many times; the one in-place output, the running statistics, is written by the launch after tuning
(`_run_grouped`'s final arguments; tuning's launches write their update to scratch) or, after the split
passes, by BatchNorm2dUpdateRunningStats, once.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .. import _mode  # noqa: F401  (first: settles Triton's mode before the kernel modules import triton)

from .. import tuning
from ..kernel import INTERPRETED

from ..ops.batch_norm.eval import (
    BatchNorm2dEvalBackward,
    BatchNorm2dEvalBackwardGrouped,
    BatchNorm2dEvalForward,
    BatchNorm2dEvalForwardGrouped,
    BatchNorm2dSumPartials,
)
from ..ops.batch_norm.train import (
    BatchNorm2dPartialGradSums,
    BatchNorm2dPartialStats,
    BatchNorm2dTrainBackwardDx,
    BatchNorm2dTrainBackwardFused,
    BatchNorm2dTrainForwardFused,
    BatchNorm2dTrainNormalize,
    BatchNorm2dUpdateRunningStats,
    CPU_TILE,
    GPU_PROGRAMS,
    GPU_TILE,
    batch_norm_plan,
    fused_channels,
    grouped_plan,
)
from ..ops.common.host_math import next_power_of_2

# The kernel classes this op launches (for `nnkernels list`).
KERNEL_CLASSES = (
    BatchNorm2dPartialStats, BatchNorm2dTrainNormalize, BatchNorm2dTrainForwardFused, BatchNorm2dPartialGradSums,
    BatchNorm2dTrainBackwardDx, BatchNorm2dTrainBackwardFused, BatchNorm2dUpdateRunningStats,
    BatchNorm2dEvalForward, BatchNorm2dEvalBackward, BatchNorm2dSumPartials, BatchNorm2dEvalForwardGrouped,
    BatchNorm2dEvalBackwardGrouped,
)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
F32 = torch.float32

log = logging.getLogger("nnkernels")
_last_kernels: dict[str, list[str]] = {}


def last_kernels() -> dict[str, list[str]]:
    """{step: [kernel ids]} for the latest call of each step ("train_forward", "eval_backward", ...)."""
    return {step: list(ids) for step, ids in _last_kernels.items()}


@functools.lru_cache(maxsize=None)
def _kernel(cls, dtype, *constants, num_warps=None):
    return cls(*constants, dtype=dtype, num_warps=num_warps)


def _run(step, launches):
    """Launch [(kernel, args)] in order and record their ids under `step`."""
    for kernel, args in launches:
        kernel.launch(*args)
    _last_kernels[step] = [kernel.id for kernel, _ in launches]
    log.debug("batch_norm %s: %s", step, ", ".join(_last_kernels[step]))


def _dims(x):
    """x viewed as [B, C, HW] (any input of 2 or more dimensions, as PyTorch takes it)."""
    B, C = x.shape[0], x.shape[1]
    HW = x.numel() // (B * C) if B * C else 0
    return B, C, HW


def _params(x, weight, bias):
    """fp32 weight and bias (ones and zeros where None)."""
    C = x.shape[1]
    weight = weight.to(F32).contiguous() if weight is not None else torch.ones(C, device=x.device, dtype=F32)
    bias = bias.to(F32).contiguous() if bias is not None else torch.zeros(C, device=x.device, dtype=F32)
    return weight, bias


def _plan(x):
    B, C, HW = _dims(x)
    return batch_norm_plan(B, C, HW, element_size=x.element_size())


# Tuning candidates of a grouped launch after the heuristic's plan, most promising first (`choose` times the
# first three unless NNKERNELS_TUNE=full): (elements per tile, num_warps). Tiles of 4K elements at 4 warps and
# 8K at 8 hold 32 elements per thread; smaller tiles mean more programs, whose loads, reductions and stores
# overlap; larger ones load longer rows in wider vectors (more channels per row). The last one only shows
# where channels per program are few (the list is cut at MOST_GROUPED_CANDIDATES).
GROUPED_SHAPES = ((8192, 8), (4096, 4), (16384, 8), (8192, 4), (4096, 8), (16384, 4), (2048, 4))
# The training forward holds one tile (x) per program where a backward holds two (dy, x); on B32 C2048 7x7 its
# fastest configs ran 4K and 8K-element tiles at 1 and 2 warps (fp32 13.2 and 13.8 µs against 14.8 for the
# best of GROUPED_SHAPES, bf16 10.7 and 11.6 against 13.1; BENCHMARKS.md, twenty-first session), which
# GROUPED_SHAPES never offers: they come first in its list.
GROUPED_FORWARD_SHAPES = ((4096, 1), (8192, 2))
# Candidates keep at least one program per SM of an H200, and 128 elements per warp (4 per thread).
GROUPED_MIN_PROGRAMS = 132
ELEMENTS_PER_WARP = 128
# and at most this many elements per thread, where a tile holds more than `shapes` meant (a channel of 14x14
# rounds up to 256 columns), so that the registers hold them.
MOST_ELEMENTS_PER_THREAD = 128
MOST_GROUPED_CANDIDATES = 6


def grouped_candidates(B, C, HW, element_size, heuristic_channels, *, step="", shapes=None,
                       min_programs=GROUPED_MIN_PROGRAMS):
    """Configs a grouped (several channels per program) batch-norm launch of `step` is tuned over: first the
    plan's own guess (`heuristic_channels`, 8 warps), then per (tile, num_warps) of `shapes` (by default
    GROUPED_SHAPES, after GROUPED_FORWARD_SHAPES for the "train_forward" step) the channels per program that
    `fused_channels` fits in about `tile` elements with at least `min_programs` programs, preferring rows
    that load 16 bytes at once; num_warps at most one per ELEMENTS_PER_WARP elements of the tile and at
    least one per 32 * MOST_ELEMENTS_PER_THREAD; duplicates dropped, at most MOST_GROUPED_CANDIDATES. On
    B32 C2048 7x7 (fp32 and bf16): channels / warps 4/8, 2/4, 8/8, 4/4, 2/8, 8/4 (tiles [32, 256],
    [32, 128], [32, 512]: 512, 1024, 256 programs); for the training forward 4/8, 2/1, 4/2, 2/4, 8/8, 4/4.

    A `tuning.Config` holds one as: block_m = BLOCK_B (images per tile), block_n = BLOCK_J (columns per
    tile), block_k = CHANNELS (channels per program), num_warps; num_stages and split unused (no loop).
    The vector width is not a choice: `grouped_plan` takes the widest one the channels' rows allow."""
    if shapes is None:
        shapes = (GROUPED_FORWARD_SHAPES if step == "train_forward" else ()) + GROUPED_SHAPES

    def config(channels, num_warps):
        plan = grouped_plan(B, C, HW, channels, element_size)
        elements = plan.block_b * plan.block_j
        num_warps = max(1, min(num_warps, elements // ELEMENTS_PER_WARP),
                        elements // (32 * MOST_ELEMENTS_PER_THREAD))
        return tuning.Config(plan.block_b, plan.block_j, channels, num_warps)

    configs = [config(heuristic_channels, 8)]
    configs += [config(fused_channels(B, C, HW, element_size, tile, min_programs, vector_bytes=16), num_warps)
                for tile, num_warps in shapes]
    return list(dict.fromkeys(configs))[:MOST_GROUPED_CANDIDATES]


@functools.lru_cache(maxsize=None)
def _grouped_kernel(cls, dtype, plan, num_warps, more_constants):
    constants = (plan.block_b, plan.block_j, plan.vector, *more_constants)
    return cls(*((plan.block_c,) if "BLOCK_C" in cls.constant_names else ()), *constants, dtype=dtype,
               num_warps=num_warps)


def _run_grouped(step, cls, x, plan, arguments, *, more_constants=(), final_arguments=None):
    """Launch the grouped kernel `cls` for `step` with the config tuning picks for x's shape and dtype;
    `arguments(channels)` are its launch arguments for `channels` channels per program, and
    `final_arguments(channels)` (default: the same) those of the one launch after tuning, where an output
    must be written once (tuning runs the kernel several times). `more_constants` follow the tile's."""
    B, C, HW = _dims(x)
    size = x.element_size()

    def run(config, arguments=arguments):
        kernel = _grouped_kernel(cls, x.dtype, grouped_plan(B, C, HW, config.block_k, size), config.num_warps,
                                 more_constants)
        _run(step, [(kernel, arguments(config.block_k))])

    chosen = tuning.choose(f"batch_norm_{step}_grouped", (B, C, HW, str(x.dtype)),
                           lambda: grouped_candidates(B, C, HW, size, plan.channels, step=step), run)
    run(chosen, final_arguments or arguments)


# Tuning candidates of the split training passes (two kernels each), the heuristic's first: (elements per
# tile, programs aimed at, num_warps); `choose` times the first three unless NNKERNELS_TUNE=full. On the H200
# (BENCHMARKS.md, eighth session) the forward ran 5% to 12% faster on 4K or 8K-element tiles than on the
# heuristic's 2K (bf16 B32 C256 56x56: 56.5 -> 50.8 µs at 4K tiles over twice the programs; B256 C64
# 112x112: 401 -> 355 at 8K), the backward best on 8K tiles over twice the programs on B32 C256 (bf16 76.1
# -> 72.2) and within 1% of the best on the heuristic's tile over twice the programs on B256 C64.
SPLIT_SHAPES = {
    "train_forward": ((GPU_TILE, GPU_PROGRAMS, 4), (8192, 2 * GPU_PROGRAMS, 4), (4096, 2 * GPU_PROGRAMS, 4),
                      (2048, 2 * GPU_PROGRAMS, 4), (8192, GPU_PROGRAMS, 4)),
    "train_backward": ((GPU_TILE, GPU_PROGRAMS, 4), (2048, 2 * GPU_PROGRAMS, 4), (8192, 2 * GPU_PROGRAMS, 4),
                       (4096, 2 * GPU_PROGRAMS, 8), (8192, GPU_PROGRAMS, 4)),
}


def split_candidates(step, *, gpu=not INTERPRETED):
    """Configs a split training pass (`step` "train_forward" or "train_backward") is tuned over:
    block_m = elements per tile and block_n = programs aimed at (`batch_norm_plan`'s tile and programs),
    num_warps; block_k, num_stages and split unused. In the interpreter one: the CPU plan (few, large tiles)."""
    if not gpu:
        return [tuning.Config(CPU_TILE, 1, 1, 4)]
    return [tuning.Config(tile, programs, 1, num_warps) for tile, programs, num_warps in SPLIT_SHAPES[step]]


def _run_split(step, x, launches):
    """Launch the split passes of `step` with the config tuning picks for x's shape and dtype;
    `launches(plan, num_warps)` are their [(kernel, args)] for one plan."""
    B, C, HW = _dims(x)

    def run(config):
        plan = batch_norm_plan(B, C, HW, element_size=x.element_size(), tile=config.block_m,
                               programs=config.block_n)
        _run(step, launches(plan, config.num_warps))

    run(tuning.choose(f"batch_norm_{step}_split", (B, C, HW, str(x.dtype)), lambda: split_candidates(step), run))


def _stats(x, n):
    return [torch.empty(n, device=x.device, dtype=F32) for _ in range(4)]


def _train_forward(x, weight, bias, eps, running=None, momentum=0.0):
    """The training forward's launches: y, mean, rstd, var_unbiased; with `running` = (running_mean,
    running_var), also their update in place, once (the fused kernel does it, the split passes launch
    BatchNorm2dUpdateRunningStats after them)."""
    x = x.contiguous()
    B, C, HW = _dims(x)
    weight, bias = _params(x, weight, bias)
    y = torch.empty_like(x)
    mean, rstd, var_unbiased, _ = _stats(x, C)
    plan = _plan(x)
    if plan.fused:
        # Without running statistics the kernel never touches its four running pointers: mean and
        # var_unbiased stand in. While tuning, the updated values go to scratch, so that the running
        # statistics are updated once, by the launch after.
        old = running if running is not None else (mean, var_unbiased)

        def arguments(channels, new):
            return (x, y, weight, bias, mean, rstd, var_unbiased, *old, *new, B, C, HW, channels, eps, momentum)

        def tuning_arguments(channels):
            return arguments(channels, old if running is None else [torch.empty_like(mean) for _ in range(2)])

        _run_grouped("train_forward", BatchNorm2dTrainForwardFused, x, plan, tuning_arguments,
                     more_constants=(running is not None,), final_arguments=lambda channels: arguments(channels, old))
        return y, mean, rstd, var_unbiased

    def launches(plan, num_warps):
        count, partial_mean, partial_m2 = (x.new_empty(C * plan.num_chunks, dtype=F32) for _ in range(3))
        stats = _kernel(BatchNorm2dPartialStats, x.dtype, plan.block_b, plan.block_hw, num_warps=num_warps)
        normalize = _kernel(BatchNorm2dTrainNormalize, x.dtype, plan.block_b, plan.block_hw, plan.block_partials,
                            num_warps=num_warps)
        return [(stats, (x, count, partial_mean, partial_m2, B, C, HW, plan.tiles_per_chunk)),
                (normalize, (x, y, weight, bias, count, partial_mean, partial_m2, mean, rstd, var_unbiased,
                             B, C, HW, plan.num_chunks, plan.tiles_per_chunk, eps))]

    _run_split("train_forward", x, launches)
    if running is not None:
        update = _kernel(BatchNorm2dUpdateRunningStats, F32, min(1024, next_power_of_2(C)))
        _run("update_running_stats", [(update, (*running, mean, var_unbiased, C, momentum))])
    return y, mean, rstd, var_unbiased


@torch.library.custom_op("nnkernels::batch_norm_train", mutates_args=())
def batch_norm_train_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward: y, and the batch mean, rstd = 1/sqrt(var + eps) and unbiased variance (fp32, [C])."""
    return _train_forward(x, weight, bias, eps)


@batch_norm_train_op.register_fake
def _(x, weight, bias, eps):
    C = x.shape[1]
    return torch.empty_like(x), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32)


@torch.library.custom_op("nnkernels::batch_norm_train_update", mutates_args=("running_mean", "running_var"))
def batch_norm_train_update_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], running_mean: torch.Tensor,
    running_var: torch.Tensor, momentum: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward that also updates the running statistics in place,
    running = (1 - momentum) * running + momentum * batch statistic (the unbiased variance), fp32:
    y, and the batch mean and rstd (fp32, [C])."""
    y, mean, rstd, _ = _train_forward(x, weight, bias, eps, (running_mean, running_var), momentum)
    return y, mean, rstd


@batch_norm_train_update_op.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps):
    C = x.shape[1]
    return torch.empty_like(x), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32)


@torch.library.custom_op("nnkernels::batch_norm_train_backward", mutates_args=())
def batch_norm_train_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training backward: dx (the full formula through the batch statistics), dweight, dbias (fp32)."""
    dy, x = dy.contiguous(), x.contiguous()
    B, C, HW = _dims(x)
    weight, _ = _params(x, weight, None)
    dx = torch.empty_like(x)
    dweight, dbias = _stats(x, C)[:2]
    plan = _plan(x)
    if plan.fused:
        _run_grouped("train_backward", BatchNorm2dTrainBackwardFused, x, plan,
                     lambda channels: (dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, channels))
        return dx, dweight, dbias

    def launches(plan, num_warps):
        sum_dy, sum_dy_xmu = (x.new_empty(C * plan.num_chunks, dtype=F32) for _ in range(2))
        sums = _kernel(BatchNorm2dPartialGradSums, x.dtype, plan.block_b, plan.block_hw, num_warps=num_warps)
        dx_kernel = _kernel(BatchNorm2dTrainBackwardDx, x.dtype, plan.block_b, plan.block_hw, plan.block_partials,
                            num_warps=num_warps)
        return [(sums, (dy, x, mean, sum_dy, sum_dy_xmu, B, C, HW, plan.tiles_per_chunk)),
                (dx_kernel, (dy, x, dx, weight, mean, rstd, sum_dy, sum_dy_xmu, dweight, dbias,
                             B, C, HW, plan.num_chunks, plan.tiles_per_chunk))]

    _run_split("train_backward", x, launches)
    return dx, dweight, dbias


@batch_norm_train_backward_op.register_fake
def _(dy, x, weight, mean, rstd):
    C = x.shape[1]
    return torch.empty_like(x), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32)


def _train_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd, _ = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _train_backward(ctx, dy, *_stat_grads):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = batch_norm_train_backward_op(dy, x, weight, mean, rstd)
    return dx, *_param_grads(ctx, dweight, dbias), None


def _param_grads(ctx, dweight, dbias):
    weight_dtype, bias_dtype = ctx.param_dtypes
    return (None if weight_dtype is None else dweight.to(weight_dtype),
            None if bias_dtype is None else dbias.to(bias_dtype))


batch_norm_train_op.register_autograd(_train_backward, setup_context=_train_setup)


@torch.library.custom_op("nnkernels::batch_norm_eval", mutates_args=())
def batch_norm_eval_op(
    x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], eps: float,
) -> torch.Tensor:
    """Inference forward: y = (x - running_mean) * weight / sqrt(running_var + eps) + bias."""
    x = x.contiguous()
    B, C, HW = _dims(x)
    weight, bias = _params(x, weight, bias)
    y = torch.empty_like(x)
    plan = _plan(x)
    if plan.fused:
        _run_grouped("eval_forward", BatchNorm2dEvalForwardGrouped, x, plan,
                     lambda channels: (x, y, weight, bias, running_mean, running_var, B, C, HW, channels, eps))
        return y
    forward = _kernel(BatchNorm2dEvalForward, x.dtype, plan.block_b, plan.block_hw)
    _run("eval_forward", [(forward, (x, y, weight, bias, running_mean, running_var, B, C, HW,
                                     plan.tiles_per_chunk, eps))])
    return y


@batch_norm_eval_op.register_fake
def _(x, running_mean, running_var, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("nnkernels::batch_norm_eval_backward", mutates_args=())
def batch_norm_eval_backward_op(
    dy: torch.Tensor, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
    weight: Optional[torch.Tensor], eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inference backward: dx = weight * rstd * dy, and dweight, dbias (fp32) over the batch."""
    dy, x = dy.contiguous(), x.contiguous()
    B, C, HW = _dims(x)
    weight, _ = _params(x, weight, None)
    dx = torch.empty_like(x)
    dweight, dbias = _stats(x, C)[:2]
    plan = _plan(x)
    if plan.fused:
        _run_grouped("eval_backward", BatchNorm2dEvalBackwardGrouped, x, plan,
                     lambda channels: (dy, x, dx, weight, running_mean, running_var, dweight, dbias, B, C, HW,
                                       channels, eps))
        return dx, dweight, dbias
    backward = _kernel(BatchNorm2dEvalBackward, x.dtype, plan.block_b, plan.block_hw)
    common = (B, C, HW, plan.tiles_per_chunk, eps)
    if plan.num_chunks == 1:
        _run("eval_backward", [(backward, (dy, x, dx, weight, running_mean, running_var, dweight, dbias, *common))])
        return dx, dweight, dbias
    partial_dweight, partial_dbias = (torch.empty(C * plan.num_chunks, device=x.device, dtype=F32) for _ in range(2))
    block_c = max(1, 4096 // plan.block_partials)
    total = _kernel(BatchNorm2dSumPartials, x.dtype, block_c, plan.block_partials)
    _run("eval_backward", [
        (backward, (dy, x, dx, weight, running_mean, running_var, partial_dweight, partial_dbias, *common)),
        (total, (partial_dweight, partial_dbias, dweight, dbias, C, plan.num_chunks)),
    ])
    return dx, dweight, dbias


@batch_norm_eval_backward_op.register_fake
def _(dy, x, running_mean, running_var, weight, eps):
    C = x.shape[1]
    return torch.empty_like(x), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32)


def _eval_setup(ctx, inputs, output):
    x, running_mean, running_var, weight, bias, eps = inputs
    ctx.save_for_backward(x, running_mean, running_var, weight)
    ctx.eps = eps
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _eval_backward(ctx, dy):
    x, running_mean, running_var, weight = ctx.saved_tensors
    dx, dweight, dbias = batch_norm_eval_backward_op(dy, x, running_mean, running_var, weight, ctx.eps)
    return dx, None, None, *_param_grads(ctx, dweight, dbias), None


batch_norm_eval_op.register_autograd(_eval_backward, setup_context=_eval_setup)


class _TrainUpdatingRunningStats(torch.autograd.Function):
    """The training forward with the running statistics updated in the same op
    (`nnkernels::batch_norm_train_update`), differentiable in x, weight and bias through
    `nnkernels::batch_norm_train_backward`. A Function, not `register_autograd`: PyTorch takes autograd
    formulas only on functional custom operators, and this one mutates its running statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        y, mean, rstd = batch_norm_train_update_op(x, weight, bias, running_mean, running_var, momentum, eps)
        _train_setup(ctx, (x, weight, bias, eps), (y, mean, rstd, None))
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dweight, dbias, _ = _train_backward(ctx, dy)
        return dx, dweight, dbias, None, None, None, None


def _check(x, running_mean, running_var, weight, bias, training, momentum, eps):
    """Validate every argument (nothing is launched or written before this passes)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x: expected at least 2 dimensions (B, C, ...), got shape {tuple(x.shape)}")
    C = x.shape[1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected None or a float tensor, got {getattr(tensor, 'dtype', tensor)!r}")
        if tensor.shape != (C,):
            raise ValueError(f"{name}: expected shape ({C},) for the {C} channels of x, got {tuple(tensor.shape)}")
        if tensor.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} like x, got {tensor.device}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean, running_var: expected both or neither, got only one")
    if running_mean is None and not training:
        raise ValueError("running_mean: expected a tensor in evaluation mode (training=False), got None")
    for name, tensor in (("running_mean", running_mean), ("running_var", running_var)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != F32:
            raise ValueError(f"{name}: expected a float32 tensor, got {getattr(tensor, 'dtype', tensor)!r}")
        if tensor.shape != (C,) or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float32 tensor of shape ({C},), got {tuple(tensor.shape)}")
        if tensor.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} like x, got {tensor.device}")
    if not isinstance(training, bool):
        raise TypeError(f"training: expected a bool, got {training!r}")
    if momentum is None:
        raise TypeError("momentum: expected a float; for a cumulative average pass 1 / num_batches_tracked")
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
        raise TypeError(f"momentum: expected a float, got {momentum!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    if training and x.numel() // max(C, 1) == 1:
        raise ValueError(f"x: Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
    if any(size == 0 for size in x.shape[1:]):  # not min(): torch.compile's symbolic sizes take no default=
        raise ValueError(f"x: expected non-empty channels and spatial sizes (the batch may be 0), got {tuple(x.shape)}")


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """`torch.nn.functional.batch_norm` with the same arguments and results, on nnkernels' kernels.

    x: (B, C, ...) float32/float16/bfloat16; weight and bias: (C,) or None; running_mean and
    running_var: (C,) float32 (statistics are always fp32, as under autocast), or None in
    training mode (batch statistics only, nothing updated). In training mode the batch mean and
    biased variance normalise x and, when running statistics are given, update them in place:
    running = (1 - momentum) * running + momentum * batch statistic, with the unbiased variance.
    momentum must be a float: `momentum=None` (PyTorch's cumulative average) is the module's job,
    which passes 1 / num_batches_tracked. Bad arguments raise before anything is written.
    """
    _check(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if x.shape[0] == 0:
        # An empty batch, as PyTorch treats it: an empty result, zero parameter gradients, no statistics.
        scale = (1,) * (x.dim() - 2)
        y = x.clone()
        for param in (weight, bias):
            if param is not None:
                y = y + (param.to(x.dtype).view(1, -1, *scale) * 0) * x.sum()
        return y
    if not training:
        return batch_norm_eval_op(x, running_mean, running_var, weight, bias, float(eps))
    if running_mean is None:
        return batch_norm_train_op(x, weight, bias, float(eps))[0]
    return _TrainUpdatingRunningStats.apply(x, weight, bias, running_mean, running_var, float(momentum), float(eps))
