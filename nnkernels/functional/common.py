"""What every functional op shares: the float dtypes, the kernel-object factory, plan caches, the kernels each op
launches (`KERNELS`, `last_kernels`) and the debug log of launches.

A plan is what the first call with a signature builds (checks, choices, tuning, kernels bound to their grids)
and every later call with that signature runs; `PlanCache` holds an op's plans.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time

import torch

from .. import compile_jobs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# 16-byte alignment of every tensor a plan receives: what Triton specialised its first launch on.
ALIGNMENT = 16

log = logging.getLogger("nnkernels")


class ArgumentError(ValueError, RuntimeError):
    """An argument the op cannot take (a shape, channel count, device or value that disagrees): a ValueError, and a
    RuntimeError too, since torch.nn.functional raises RuntimeError for the same mistakes and code written against
    torch catches that."""

# One lock for building plans: a build may tune, and tuning times kernels best with nothing else launching.
_BUILDING = threading.RLock()
SLOW_BUILD_S = 2.0
_slow_builds = 0
_CACHES: list["PlanCache"] = []
# op name -> the kernel classes it launches (`nnkernels list`); op name -> {step: kernel ids} of its latest calls
KERNELS: dict[str, tuple] = {}
_LAST: dict[str, dict[str, list[str]]] = {}


@functools.lru_cache(maxsize=None)
def kernel(cls, *constants, dtype, num_warps=None, num_stages=None):
    """One kernel object per class, constants, dtype and launch options."""
    return cls(*constants, dtype=dtype, num_warps=num_warps, num_stages=num_stages)


# The operators torch.compile sees, defined on torch.library's own API rather than `torch.library.custom_op`: the
# same schema, fake and autograd for less of each call's host time (custom_op wraps every call in Python checks;
# docs/notes.md, "Host time"), which a compiled graph pays per op.
OPS = torch.library.Library("nnkernels", "FRAGMENT")


def operator(name: str, mutates_args=(), derivative=True):
    """Decorator: `fn`, annotated as `torch.library.custom_op` takes it, becomes the operator `nnkernels::<name>`
    (for every device); returns the operator, which callers call so that tracing sees it. `derivative`: whether
    `register_autograd` gives it one; without, a backward through it raises (`_refuse_autograd`)."""
    def define(fn):
        OPS.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        OPS.impl(name, fn, "CompositeExplicitAutograd")
        if not derivative:
            _refuse_autograd(name)
        return getattr(torch.ops.nnkernels, name).default

    return define


def register_fake(name: str):
    """Decorator: the fake (meta) implementation of `nnkernels::<name>`."""
    return torch.library.register_fake(f"nnkernels::{name}", lib=OPS)


def register_autograd(name: str, backward, setup_context):
    torch.library.register_autograd(f"nnkernels::{name}", backward, setup_context=setup_context, lib=OPS)


def _refuse_autograd(name: str):
    """Make a backward through `nnkernels::<name>` (a backward operator, which has no derivative of its own) raise,
    where without an autograd kernel torch would carry on with no gradient."""
    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through nnkernels.{name}, which has no autograd formula: second "
                           "derivatives through the operators torch.compile sees are not implemented (eagerly they "
                           "work)")

    register_autograd(name, backward, lambda ctx, inputs, output: None)


def stored_config(config_type):
    """The `decode` that tuning reads a stored config of `config_type` back with: the dict of its fields."""
    return lambda stored: config_type(**stored)


def register_kernels(op: str, classes: tuple):
    """Record the kernel classes `op` launches, for `nnkernels list` and the tests that walk them."""
    KERNELS[op] = tuple(dict.fromkeys(KERNELS.get(op, ()) + tuple(classes)))


def record(op: str, step: str, ids: list[str]):
    """Note the kernels `op`'s latest `step` launched (a plan's list, made once) and log them at DEBUG level."""
    _LAST.setdefault(op, {})[step] = ids
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s launches %s", op, step, ", ".join(ids))


def last_kernels(op: str) -> dict[str, list[str]]:
    """{step: [kernel ids]} of the latest call of each step of `op` ("forward", "dx", "train_backward", ...)."""
    return {step: list(ids) for step, ids in _LAST.get(op, {}).items()}


def refuse_double_backward(op: str):
    """Raise where a backward runs with create_graph=True: its gradients would carry no graph, so second derivatives
    would come out silently zero."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: second derivatives (autograd with create_graph=True) are not implemented")


def elsewhere(device: torch.device):
    """A context that makes `device` the current GPU, or None where it is current already (or not a GPU): a plan's
    kernels launch on the current GPU, as Triton's launcher does."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return None
    return torch.cuda.device(device)


def allocator(dtype: torch.dtype, device: torch.device):
    """`new(*shape)`: an uninitialised tensor of `dtype` on `device`, as `torch.empty` makes it; a template's
    `new_empty` with the sizes as arguments takes half the host time of `torch.empty(shape, dtype=, device=)`."""
    return torch.empty(0, dtype=dtype, device=device).new_empty


def channels_last_allocator(dtype: torch.dtype, device: torch.device):
    """`new(n, c, h, w)`: an uninitialised [n, c, h, w] tensor stored NHWC (torch.channels_last), a tensor of its
    own rather than a permuted view, so that autograd lets an op's channels-last output be modified in place."""
    def new(n, c, h, w):
        return torch.empty((n, c, h, w), dtype=dtype, device=device, memory_format=torch.channels_last)

    return new


def fp32_rows_length(n: int) -> int:
    """n rounded up to whole 16-byte groups of fp32: the row length of a buffer whose rows all start aligned."""
    return -(-n // 4) * 4


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it where its data is not ALIGNMENT-byte aligned (a view at an odd offset)."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def direct_apply(function: type[torch.autograd.Function]):
    """`function.apply` without torch's Python wrapper, whose cost shows in every eager call (docs/notes.md, "Host
    time"): outside functorch transforms that wrapper only unwraps dead functorch wrappers (done here, on the
    tensor arguments) before the C apply; under a transform (vmap, grad) the call takes the wrapper."""
    c_apply = super(torch.autograd.Function, function).apply
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap, tensor = torch._C._functorch.unwrap_if_dead, torch.Tensor

    def apply(*args):
        if transforms_active():
            return function.apply(*args)
        return c_apply(*[unwrap(arg) if isinstance(arg, tensor) else arg for arg in args])

    return apply


class PlanCache:
    """signature -> plan. `get(signature)` answers in one dict lookup; `build(signature, make)` runs `make()` once
    per signature (under one lock for all ops) and keeps its plan unless `make` raises."""

    def __init__(self):
        self._plans: dict = {}
        _CACHES.append(self)

    def get(self, signature):
        return self._plans.get(signature)

    def build(self, signature, make):
        with _BUILDING:
            plan = self._plans.get(signature)
            if plan is None:
                plan = make()
                self._plans[signature] = plan
            return plan

    def clear(self):
        self._plans.clear()


@contextlib.contextmanager
def building(op: str, step: str, shape, jobs=(), unneeded=()):
    """Held while a plan makes its choices for `step` on its first call and runs it (compiling kernels, tuning on
    the GPU, the chosen kernels' first launches): one lock for all ops, and one log line where that takes longer
    than SLOW_BUILD_S, at WARNING level the first time in a process (so that a user sees what the wait was), at
    INFO after. `jobs`: the (layer shape, part) jobs of background compiles this build does (`compile_jobs`);
    `unneeded`: those of the same layer it has no use for."""
    global _slow_builds
    began = time.perf_counter()
    with _BUILDING:
        compile_jobs.claim(*jobs)
        compile_jobs.drop(*unneeded)
        yield
    took = time.perf_counter() - began
    if took > SLOW_BUILD_S:
        level = logging.WARNING if not _slow_builds else logging.INFO
        _slow_builds += 1
        log.log(level, "nnkernels: %s %s of %s: %.1f s to compile and tune, once per shape%s", op, step,
                "x".join(map(str, shape)), took, " (nnkernels.warmup(model, inputs) does it ahead of training)"
                if level == logging.WARNING else "")


def clear_plans():
    """Forget every op's plans, so the next calls choose their kernels again (after a change of tuning
    settings, say)."""
    for cache in _CACHES:
        cache.clear()
