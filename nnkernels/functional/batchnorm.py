"""`batch_norm`: `torch.nn.functional.batch_norm` on nnkernels' kernels, with autograd and torch.compile.

A call's signature (x's shape, strides, dtype and device; those of weight, bias and the running statistics;
training) finds its `BatchNormPlan`, built (arguments checked) on the signature's first call. Each pass it runs
(training forward and backward, evaluation forward and backward) chooses its config on its first call
(`batchnorm_algorithms`, tuned on the GPU) and binds its kernels. The training forward updates the running
statistics in place in the launch that writes y (the grouped kernel, or the split's second pass); while it is
tuned, the updates go to scratch, so the statistics change once.

Eagerly, autograd goes through `torch.autograd.Function`s around the plan, applied without torch's Python
wrapper (`direct_apply`). Under `torch.compile` the plans run
inside custom operators with fake implementations:
- `nnkernels::batch_norm_train(x, weight, bias, eps) -> (y, mean, rstd, var_unbiased)`, with autograd through
  `nnkernels::batch_norm_train_backward`;
- `nnkernels::batch_norm_train_update(x, weight, bias, running_mean!, running_var!, momentum, eps)
  -> (y, mean, rstd)`, mutating; torch takes autograd formulas only on functional operators, so its autograd is
  a `torch.autograd.Function` (`_TrainUpdatingRunningStats`) with the same backward op;
- `nnkernels::batch_norm_eval(x, running_mean, running_var, weight, bias, eps) -> y`, with autograd through
  `nnkernels::batch_norm_eval_backward`.
`last_kernels("batch_norm")` names the kernels the latest calls launched.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._prims_common import suggest_memory_format

from .. import machine
from ..layer_shapes import BatchNormShape
from . import batchnorm_algorithms as nchw_passes
from . import batchnorm_nhwc as nhwc_passes
from .batchnorm_algorithms import F32, BatchNormProblem
from .common import (ALIGNMENT, FLOAT_DTYPES, ArgumentError, PlanCache, aligned, building, direct_apply, elsewhere,
                     operator, record, register_autograd, register_fake, register_kernels)
from .double_backward import batch_norm_eval_grads, batch_norm_train_grads
from .layout import as_channels_last, nchw
from .. import tuning

_PLANS = PlanCache()


def _check(x, running_mean, running_var, weight, bias, training, momentum, eps):
    """Validate every argument (nothing is launched or written before this passes)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ArgumentError(f"x: expected at least 2 dimensions (B, C, ...), got shape {tuple(x.shape)}")
    C = x.shape[1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected None or a float tensor, got {getattr(tensor, 'dtype', tensor)!r}")
        if tensor.shape != (C,):
            raise ArgumentError(f"{name}: expected shape ({C},) for the {C} channels of x, got {tuple(tensor.shape)}")
        if tensor.device != x.device:
            raise ArgumentError(f"{name}: expected a tensor on {x.device} like x, got {tensor.device}")
    if (running_mean is None) != (running_var is None):
        raise ArgumentError("running_mean, running_var: expected both or neither, got only one")
    if running_mean is None and not training:
        raise ArgumentError("running_mean: expected a tensor in evaluation mode (training=False), got None")
    for name, tensor in (("running_mean", running_mean), ("running_var", running_var)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != F32:
            raise ArgumentError(f"{name}: expected a float32 tensor, got {getattr(tensor, 'dtype', tensor)!r}")
        if tensor.shape != (C,):
            raise ArgumentError(f"{name}: expected a float32 tensor of shape ({C},), got {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ArgumentError(f"{name}: expected a contiguous tensor (the kernels update it in place), got strides "
                             f"{tuple(tensor.stride())}")
        if tensor.device != x.device:
            raise ArgumentError(f"{name}: expected a tensor on {x.device} like x, got {tensor.device}")
    if not isinstance(training, bool):
        raise TypeError(f"training: expected a bool, got {training!r}")
    if momentum is None:
        raise TypeError("momentum: expected a float; for a cumulative average pass 1 / num_batches_tracked")
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
        raise TypeError(f"momentum: expected a float, got {momentum!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ArgumentError(f"eps: expected a float >= 0, got {eps!r}")
    if training and not eps > 0:  # batch statistics of a constant channel would divide by zero
        raise ArgumentError(f"eps: expected a float > 0 in training, got {eps!r}")
    if training and x.numel() // max(C, 1) == 1:
        raise ArgumentError(f"x: Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
    if any(size == 0 for size in x.shape[1:]):  # not min(): torch.compile's symbolic sizes take no default=
        raise ArgumentError(f"x: expected non-empty channels and spatial sizes (the batch may be 0), got {tuple(x.shape)}")


def _info(tensor):
    return None if tensor is None else (tensor.shape, tensor.stride(), tensor.dtype, tensor.device,
                                        tensor.data_ptr() % ALIGNMENT == 0)


class BatchNormPlan:
    """What every call with one signature runs: its passes' runners, made on their first calls."""

    def __init__(self, x, weight, bias):
        # The layout torch gives this input's results, where it is not NCHW (channels-last, 4-D or 5-D).
        memory_format = suggest_memory_format(x)
        self.memory_format = None if memory_format == torch.contiguous_format else memory_format
        # A channels-last 4-D input is read where it lies, except by the evaluation backward (NCHW kernels).
        self.nhwc = memory_format == torch.channels_last and x.is_contiguous(memory_format=torch.channels_last)
        on = machine.machine_of(x.device)
        self.problem = BatchNormProblem(x.shape, x.dtype, x.device, on, nhwc=self.nhwc)
        self.nchw_problem = BatchNormProblem(x.shape, x.dtype, x.device, on) if self.nhwc else self.problem
        C, device = x.shape[1], x.device
        # fp32, contiguous parameters as the kernels read them; ones and zeros where there are none.
        self.weight_ready = weight is not None and weight.dtype == F32 and weight.is_contiguous()
        self.bias_ready = bias is not None and bias.dtype == F32 and bias.is_contiguous()
        self.ones = torch.ones(C, dtype=F32, device=device) if weight is None else None
        self.zeros = torch.zeros(C, dtype=F32, device=device) if bias is None else None
        self.runners = {}
        self.ids = {}

    def params(self, weight, bias):
        weight = self.ones if weight is None else weight if self.weight_ready else weight.to(F32).contiguous()
        bias = self.zeros if bias is None else bias if self.bias_ready else bias.to(F32).contiguous()
        return aligned(weight), aligned(bias)

    def ready(self, t):
        """`t` as this plan's training passes and evaluation forward read it: channels-last for an `nhwc` plan,
        else NCHW; 16-byte aligned."""
        return aligned(as_channels_last(t) if self.nhwc else nchw(t))

    def run(self, step, *args):
        switch = elsewhere(self.problem.device)
        if switch is not None:
            with switch:
                return self.run(step, *args)
        runner = self.runners.get(step)
        if runner is None:
            return self._first(step, args)
        record("batch_norm", step, self.ids[step])
        return runner(*args)

    def _layer_jobs(self, step):
        """The background compile jobs (`compile_jobs`) whose kernels `step` builds: a layer call's forward or
        backward."""
        part = "backward" if step.endswith("backward") else "forward"
        return [(BatchNormShape(tuple(self.problem.shape), self.nhwc, step.startswith("train"), running), part)
                for running in _RUNNING_OF_STEP.get(step, (False,))]

    def _first(self, step, args):
        with building("batch_norm", step, self.problem.shape, self._layer_jobs(step)):
            if step not in self.runners:
                problem = self.nchw_problem if step == "eval_backward" else self.problem
                self.runners[step], self.ids[step] = _tuned(problem, step, args)
            return self.run(step, *args)  # its first launches compile what no candidate timed


# Whether a layer call whose plan runs the training step updates running statistics; both for the backward.
_RUNNING_OF_STEP = {"train_forward": (False,), "train_forward_update": (True,), "train_backward": (True, False)}


def _steps(passes):
    """{step: (runner maker, kernels)} of the module `passes` (NCHW or channels-last kernels)."""
    return {
        "train_forward": (lambda p, c: passes.train_forward_runner(p, c, False),
                          lambda p, c: passes.train_forward_kernels(p, c, False)),
        "train_forward_update": (lambda p, c: passes.train_forward_runner(p, c, True),
                                 lambda p, c: passes.train_forward_kernels(p, c, True)),
        "train_backward": (passes.train_backward_runner, passes.train_backward_kernels),
        "eval_forward": (passes.eval_forward_runner, passes.eval_forward_kernels),
    }


# The evaluation backward runs on NCHW kernels for either layout (`BatchNormPlan.nchw_problem`).
_NCHW_STEPS = {**_steps(nchw_passes), "eval_backward": (nchw_passes.eval_backward_runner,
                                                        nchw_passes.eval_backward_kernels)}
_NHWC_STEPS = _steps(nhwc_passes)


def steps_of(problem) -> dict:
    """{step: (runner maker, kernels maker)} of the kernels `problem`'s layout runs (channels-last or NCHW)."""
    return _NHWC_STEPS if problem.nhwc else _NCHW_STEPS


def _tuned(problem, step, args):
    """(runner, kernel ids) of `step`'s config, tuned on this first call's arguments. The training forward that
    updates the running statistics is tuned as the one that does not (the same kernels, the update aside), and
    its timed runs write their update to scratch."""
    make, kernels = steps_of(problem)[step]
    tuned_step = "train_forward" if step == "train_forward_update" else step
    candidates, decode = problem.candidates(tuned_step)
    runners = {}

    def runner_of(config):
        if config not in runners:
            runners[config] = make(problem, config)
        return runners[config]

    def time_with(config):
        if step == "train_forward_update":
            scratch = (args[3].clone(), args[4].clone())
            return runner_of(config)(*args[:3], *scratch, *args[5:])
        return runner_of(config)(*args)

    config = candidates()[0] if decode is None else tuning.choose(problem.kind(tuned_step), problem.key, candidates,
                                                                  time_with, decode)
    return runner_of(config), [k.id for k in kernels(problem, config)]


def _plan(x, weight, bias, running_mean, running_var, training):
    try:
        signature = (x.shape, x.stride(), x.dtype, x.device, _info(weight), _info(bias), _info(running_mean),
                     _info(running_var), training)
    except AttributeError:  # not tensors: the checks say which
        _check(x, running_mean, running_var, weight, bias, training, 0.1, 1e-5)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        def build():
            _check(x, running_mean, running_var, weight, bias, training, 0.1, 1e-5)
            return BatchNormPlan(x, weight, bias)

        plan = _PLANS.build(signature, build)
    return plan


def _ready(x):
    return aligned(nchw(x))


def _laid_out(plan, t):
    """`t` in the layout torch gives for the plan's input. Outside `nhwc` plans the kernels read and write NCHW
    only, so an input of another layout costs one copy in (`_ready`) and one copy out (here)."""
    return t if plan.nhwc else _in_input_format(plan, t)


def _in_input_format(plan, t):
    if plan.memory_format is None:
        return t
    return as_channels_last(t) if plan.memory_format == torch.channels_last else t.contiguous(
        memory_format=plan.memory_format)


def _eval_dx_laid_out(plan, dx):
    """The evaluation backward's dx (NCHW kernels) in torch's layout: NCHW on CUDA (torch 2.11's CUDA backward,
    measured), the input's on the CPU."""
    return dx if plan.problem.device.type == "cuda" else _in_input_format(plan, dx)


def _param_grads(param_dtypes, dweight, dbias):
    """The fp32 parameter gradients in the parameters' own dtypes (fp32 almost always: no call then)."""
    weight_dtype, bias_dtype = param_dtypes
    return (None if weight_dtype is None else dweight if weight_dtype == F32 else dweight.to(weight_dtype),
            None if bias_dtype is None else dbias if bias_dtype == F32 else dbias.to(bias_dtype))


def _save(ctx, plan, eps, weight, bias, *tensors):
    """What both modes keep for the backward: `tensors` (x and weight as given among them, which a differentiable
    backward reaches the caller's graph through), the plan, eps and the parameters' dtypes."""
    ctx.save_for_backward(*tensors)
    ctx.plan, ctx.eps = plan, eps
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


class _Train(torch.autograd.Function):
    """Training mode, eagerly: batch statistics, the running statistics (a tuple, not autograd inputs) updated in
    place when given."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, running, momentum, eps):
        ready = plan.ready(x)
        weight32, bias32 = plan.params(weight, bias)
        if running is None:
            y, mean, rstd, _ = plan.run("train_forward", ready, weight32, bias32, None, None, eps, momentum)
        else:
            y, mean, rstd, _ = plan.run("train_forward_update", ready, weight32, bias32, *running, eps, momentum)
        _save(ctx, plan, eps, weight, bias, ready, weight32, mean, rstd, x, weight)
        return _laid_out(plan, y)

    @staticmethod
    def backward(ctx, dy):
        ready, weight32, mean, rstd, x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: torch's formula, differentiable
            dx, dweight, dbias = batch_norm_train_grads(dy, x, weight, ctx.eps)
        else:
            dx, dweight, dbias = ctx.plan.run("train_backward", ctx.plan.ready(dy), ready, weight32, mean, rstd)
            dx = _laid_out(ctx.plan, dx)
        return dx, *_param_grads(ctx.param_dtypes, dweight, dbias), None, None, None, None


class _Eval(torch.autograd.Function):
    """Evaluation mode, eagerly: the running statistics (a tuple) normalise x."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, running, eps):
        ready = plan.ready(x)
        weight32, bias32 = plan.params(weight, bias)
        y = plan.run("eval_forward", ready, weight32, bias32, *running, eps)
        _save(ctx, plan, eps, weight, bias, ready, weight32, *running, x, weight)
        return _laid_out(plan, y)

    @staticmethod
    def backward(ctx, dy):
        ready, weight32, running_mean, running_var, x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: torch's formula, differentiable
            dx, dweight, dbias = batch_norm_eval_grads(dy, x, weight, running_mean, running_var, ctx.eps)
        else:
            dx, dweight, dbias = ctx.plan.run("eval_backward", _ready(dy), _ready(ready), weight32, running_mean,
                                              running_var, ctx.eps)
            dx = _eval_dx_laid_out(ctx.plan, dx)
        return dx, *_param_grads(ctx.param_dtypes, dweight, dbias), None, None, None


_train, _eval = direct_apply(_Train), direct_apply(_Eval)


def _empty_batch(x, weight, bias):
    """An empty batch, as torch treats it: an empty result, zero parameter gradients, no statistics."""
    scale = (1,) * (x.dim() - 2)
    y = x.clone()
    for param in (weight, bias):
        if param is not None:
            y = y + (param.to(x.dtype).view(1, -1, *scale) * 0) * x.sum()
    return y


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """`torch.nn.functional.batch_norm` with the same arguments and results, on nnkernels' kernels.

    x: (B, C, ...) float32/float16/bfloat16; weight and bias: (C,) or None; running_mean and running_var: (C,)
    float32 (statistics are always fp32, as under autocast), or None in training mode (batch statistics only,
    nothing updated). In training mode the batch mean and biased variance normalise x and, when running statistics
    are given, update them in place: running = (1 - momentum) * running + momentum * batch statistic, with the
    unbiased variance. momentum must be a float: `momentum=None` (torch's cumulative average) is the module's job,
    which passes 1 / num_batches_tracked. Bad arguments raise before anything is written."""
    if torch.compiler.is_compiling() or (isinstance(x, torch.Tensor) and x.device.type == "meta"):
        return _traced(x, running_mean, running_var, weight, bias, training, momentum, eps)  # meta: the fakes
    plan = _plan(x, weight, bias, running_mean, running_var, training)
    if type(eps) is not float or type(momentum) is not float or type(training) is not bool or not (
            eps > 0 if training else eps >= 0):
        _check(x, running_mean, running_var, weight, bias, training, momentum, eps)
        eps, momentum = float(eps), float(momentum)
    if x.shape[0] == 0:
        return _empty_batch(x, weight, bias)
    if training:
        running = None if running_mean is None else (running_mean, running_var)
        return _train(x, weight, bias, plan, running, momentum, eps)
    return _eval(x, weight, bias, plan, (running_mean, running_var), eps)


def _traced(x, running_mean, running_var, weight, bias, training, momentum, eps):
    """batch_norm as torch.compile traces it: the custom operators, the checks run on the traced tensors."""
    _check(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if x.shape[0] == 0:
        return _empty_batch(x, weight, bias)
    if not training:
        return batch_norm_eval_op(x, running_mean, running_var, weight, bias, float(eps))
    if running_mean is None:
        return batch_norm_train_op(x, weight, bias, float(eps))[0]
    return _TrainUpdatingRunningStats.apply(x, weight, bias, running_mean, running_var, float(momentum), float(eps))


# ---- the custom operators torch.compile sees ----

def _fp32_stats(x):
    C = x.shape[1]
    return x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32), x.new_empty(C, dtype=F32)


@operator("batch_norm_train")
def batch_norm_train_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward: y, and the batch mean, rstd = 1/sqrt(var + eps) and unbiased variance (fp32, [C])."""
    plan = _plan(x, weight, bias, None, None, True)
    y, *stats = plan.run("train_forward", plan.ready(x), *plan.params(weight, bias), None, None, eps, 0.0)
    return _laid_out(plan, y), *stats


@register_fake("batch_norm_train")
def _(x, weight, bias, eps):
    return (torch.empty_like(x), *_fp32_stats(x))


@operator("batch_norm_train_update", mutates_args=("running_mean", "running_var"))
def batch_norm_train_update_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                               running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training forward that also updates the running statistics in place, running = (1 - momentum) * running +
    momentum * batch statistic (the unbiased variance), fp32: y, and the batch mean and rstd (fp32, [C]).
    Differentiable only inside `_TrainUpdatingRunningStats` (torch.library takes no autograd formula for an
    operator that mutates), so a call that would need one raises."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise RuntimeError("Trying to backward through nnkernels.batch_norm_train_update, which has no autograd "
                           "formula: call nnkernels.batch_norm, which differentiates it")
    plan = _plan(x, weight, bias, running_mean, running_var, True)
    y, mean, rstd, _ = plan.run("train_forward_update", plan.ready(x), *plan.params(weight, bias), running_mean,
                                running_var, eps, momentum)
    return _laid_out(plan, y), mean, rstd


@register_fake("batch_norm_train_update")
def _(x, weight, bias, running_mean, running_var, momentum, eps):
    return (torch.empty_like(x), *_fp32_stats(x)[:2])


@operator("batch_norm_train_backward", derivative=False)
def batch_norm_train_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training backward: dx (the full formula through the batch statistics), dweight, dbias (fp32)."""
    plan = _plan(x, weight, None, None, None, True)
    dx, dweight, dbias = plan.run("train_backward", plan.ready(dy), plan.ready(x), plan.params(weight, None)[0], mean,
                                  rstd)
    return _laid_out(plan, dx), dweight, dbias


@register_fake("batch_norm_train_backward")
def _(dy, x, weight, mean, rstd):
    return (torch.empty_like(x), *_fp32_stats(x)[:2])


def _train_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd, _ = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _train_backward(ctx, dy, *_stat_grads):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = batch_norm_train_backward_op(dy, x, weight, mean, rstd)
    return dx, *_param_grads(ctx.param_dtypes, dweight, dbias), None


register_autograd("batch_norm_train", _train_backward, _train_setup)


@operator("batch_norm_eval")
def batch_norm_eval_op(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                       weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Inference forward: y = (x - running_mean) * weight / sqrt(running_var + eps) + bias."""
    plan = _plan(x, weight, bias, running_mean, running_var, False)
    return _laid_out(plan, plan.run("eval_forward", plan.ready(x), *plan.params(weight, bias), running_mean,
                                    running_var, eps))


@register_fake("batch_norm_eval")
def _(x, running_mean, running_var, weight, bias, eps):
    return torch.empty_like(x)


@operator("batch_norm_eval_backward", derivative=False)
def batch_norm_eval_backward_op(dy: torch.Tensor, x: torch.Tensor, running_mean: torch.Tensor,
                                running_var: torch.Tensor, weight: Optional[torch.Tensor],
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inference backward: dx = weight * rstd * dy, and dweight, dbias (fp32) over the batch."""
    plan = _plan(x, weight, None, running_mean, running_var, False)
    dx, dweight, dbias = plan.run("eval_backward", _ready(dy), _ready(x), plan.params(weight, None)[0], running_mean,
                                  running_var, eps)
    return _eval_dx_laid_out(plan, dx), dweight, dbias


@register_fake("batch_norm_eval_backward")
def _(dy, x, running_mean, running_var, weight, eps):
    return (x.new_empty(x.shape) if x.device.type == "cuda" else torch.empty_like(x), *_fp32_stats(x)[:2])


def _eval_setup(ctx, inputs, output):
    x, running_mean, running_var, weight, bias, eps = inputs
    ctx.save_for_backward(x, running_mean, running_var, weight)
    ctx.eps = eps
    ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def _eval_backward(ctx, dy):
    x, running_mean, running_var, weight = ctx.saved_tensors
    dx, dweight, dbias = batch_norm_eval_backward_op(dy, x, running_mean, running_var, weight, ctx.eps)
    return dx, None, None, *_param_grads(ctx.param_dtypes, dweight, dbias), None


register_autograd("batch_norm_eval", _eval_backward, _eval_setup)


class _TrainUpdatingRunningStats(torch.autograd.Function):
    """`nnkernels::batch_norm_train_update`, differentiable in x, weight and bias through
    `nnkernels::batch_norm_train_backward` (what torch.compile traces)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        y, mean, rstd = batch_norm_train_update_op(x, weight, bias, running_mean, running_var, momentum, eps)
        _train_setup(ctx, (x, weight, bias, eps), (y, mean, rstd, None))
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: torch's formula, differentiable
            x, weight, _, _ = ctx.saved_tensors
            dx, dweight, dbias = batch_norm_train_grads(dy, x, weight, ctx.eps)
            return dx, *_param_grads(ctx.param_dtypes, dweight, dbias), None, None, None, None
        dx, dweight, dbias, _ = _train_backward(ctx, dy)
        return dx, dweight, dbias, None, None, None, None


def _kernel_classes():
    from ..kernel import catalogue

    return tuple(cls for cls in catalogue() if cls.__module__.startswith("nnkernels.ops.batch_norm.") and not cls.seed
                 and cls.__module__ != "nnkernels.ops.batch_norm.sync")  # SyncBatchNorm's own


register_kernels("batch_norm", _kernel_classes())
