"""Compiling ahead at a converted model's first forward, so that a training loop that never calls `warmup` does not
compile its kernels one after another as its first step reaches them.

`convert` puts a `CompileAhead` forward pre-hook on the model it returns. At the model's first eager forward on a
GPU it starts what `warmup` starts: the kernels of every convolution, batch norm and average pooling of one forward
and backward (their shapes from a pass on the meta device) compiling in background processes (each layer's forward
in the step's order, then the backwards in reverse), while the step runs and loads what they have built (a layer
the step reaches first it takes from their queue, one a worker is compiling it waits for: `compile_jobs`). At the
model's next forward, the first step being done, or at the process's exit, whichever comes first, it stops them. A
set of layers once compiled whole leaves a marker in Triton's cache directory (keyed by the shapes, dtype, GPU,
versions, kernels' code and the choices this machine's tuning remembers for the convolutions), and a later process
with that marker starts no processes. `NNKERNELS_COMPILE_AHEAD=off` turns it off and `NNKERNELS_COMPILE_JOBS=N`
sets how many processes (1: none); under torch.compile, in Triton's interpreter and for inputs not on a GPU it does
nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from ._aot import MOST_JOBS, default_jobs
from ._mode import INTERPRETED

ENV = "NNKERNELS_COMPILE_AHEAD"
JOBS_ENV = "NNKERNELS_COMPILE_JOBS"
GPU_DEVICE_TYPES = ("cuda",)  # where a step compiles its kernels
WORKER_CONTEXT_BYTES = 2**29  # what a CUDA context holds on the GPU, about
log = logging.getLogger("nnkernels")
_suppressed = threading.local()  # set while warmup runs, and while the meta pass copies the model


@contextlib.contextmanager
def suppressed():
    """No `CompileAhead` hook starts anything inside (warmup, which compiles ahead itself; the meta pass)."""
    before = getattr(_suppressed, "on", False)
    _suppressed.on = True
    try:
        yield
    finally:
        _suppressed.on = before


class CompileAhead:
    """The forward pre-hook `convert` registers (see the module docstring). A copied or pickled model's hook starts
    afresh: what it holds (worker processes) belongs to one process."""

    def __init__(self):
        self._reset()

    def _reset(self):
        self.forwards, self.compiling, self.key = 0, None, None

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self._reset()

    def done(self):
        """Start nothing from now on (warmup compiled what a step needs)."""
        self.forwards = 2

    def __call__(self, model, args):
        if torch.compiler.is_compiling() or self.forwards > 1 or getattr(_suppressed, "on", False):
            return
        self.forwards += 1
        if self.forwards == 1:
            with suppressed():
                self.compiling, self.key = _start(model, args)
            if self.compiling is not None:
                # A process that runs one step (a benchmark, a first try) ends before a second forward.
                atexit.register(self.finish)
        else:
            self.finish()

    def finish(self):
        """Stop the workers (once), leaving the marker where they had compiled every shape."""
        if self.compiling is not None:
            _finish(self.compiling, self.key)
            self.compiling = None


def attach(model: torch.nn.Module):
    """Give `model` a `CompileAhead` hook unless it has one."""
    if not any(isinstance(hook, CompileAhead) for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(CompileAhead())


def mark_done(model: torch.nn.Module):
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, CompileAhead):
            hook.done()


def background_jobs() -> int:
    """Processes that compile ahead for this process: `NNKERNELS_COMPILE_JOBS` where set, else one per CPU (at
    most `MOST_JOBS`) shared among the processes torchrun started on this machine. 1 means none: the step compiles
    as it goes."""
    value = os.environ.get(JOBS_ENV)
    if value is None:
        return max(1, default_jobs(MOST_JOBS) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{JOBS_ENV}: expected an integer >= 1, got {value!r}")
    return int(value)


def affordable_jobs(jobs: int, free_bytes: int | None, shapes, dtype) -> int:
    """How many of `jobs` workers may start with `free_bytes` of GPU memory free (None: no limit): each takes
    about WORKER_CONTEXT_BYTES for its CUDA context and room for four times the tensors of the largest layer call
    (`elements`), and together they take at most a quarter of what is free, so that the step keeps the rest."""
    if free_bytes is None:
        return jobs
    per_worker = WORKER_CONTEXT_BYTES + 4 * max(shape.elements() for shape in shapes) * dtype.itemsize
    return min(jobs, free_bytes // 4 // per_worker)


def _start(model, args):
    """(the `Precompiling` started, the marker key), or (None, None) where nothing needs compiling."""
    if os.environ.get(ENV, "on").lower() in ("0", "off", "false", "no") or INTERPRETED:
        return None, None
    device = next((t.device for t in args if isinstance(t, torch.Tensor)), None)
    if device is None or device.type not in GPU_DEVICE_TYPES:
        return None, None
    from .step_warmup import _conv_dtype, shapes_of_step, start_compiling_shapes

    try:
        shapes = shapes_of_step(model, args)
    except Exception:  # noqa: BLE001  (the forward that follows raises what the model raises, or runs as it can)
        log.info("nnkernels: compiling ahead found no layers on the meta device", exc_info=True)
        return None, None
    if not shapes:
        return None, None
    dtype = _conv_dtype(model, args)
    key = (shapes, dtype, device)
    if _marker(key).exists():
        return None, None
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    jobs = affordable_jobs(background_jobs(), free, shapes, dtype)
    if jobs < 2:  # one process is the step compiling as it goes, as `warmup(jobs=1)` takes it
        return None, None
    log.info("nnkernels: compiling the kernels of %d layer shapes in %d background processes (%s=off turns this "
             "off)", len(shapes), jobs, ENV)
    return start_compiling_shapes(shapes, dtype, jobs, str(device), "nnkernels: compiling ahead"), key


def _finish(compiling, key):
    """Stop the workers; where they had compiled every shape, leave the marker."""
    complete = compiling.finished() and not compiling.failures
    from .step_warmup import _stop

    _stop(compiling, "nnkernels: compiling ahead")
    if complete:
        path = _marker(key)
        with contextlib.suppress(OSError):  # without it, a later process compiles ahead again: slower, not wrong
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()


def _marker(key) -> Path:
    """The file that says the kernels of `key` = (shapes, dtype, device) are in Triton's cache."""
    import triton

    from . import __version__, tuning
    from .functional.conv import remembered_choices
    from .layer_calls import ConvShape

    shapes, dtype, device = key
    # The convolutions' remembered choices, which decide what their workers compile (a batch norm's or a pooling's
    # compile the choices their tuning may time, whatever it remembers); not the whole tuning cache.
    choices = sorted(repr((shape, remembered_choices(shape.x_shape, shape.w_shape, shape.stride, shape.padding,
                                                     shape.dilation, shape.groups, dtype, shape.bias,
                                                     shape.channels_last) if isinstance(shape, ConvShape) else None))
                     for shape in shapes)
    parts = (choices, str(dtype), torch.backends.cudnn.allow_tf32, gpu_name(device), torch.__version__,
             triton.__version__, __version__, tuning.mode(),
             *(tuning.kernels_fingerprint(layer) for layer in ("conv2d", "batch_norm", "avg_pool2d")))
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    return _triton_cache_dir() / "nnkernels-compiled-ahead" / digest


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _triton_cache_dir() -> Path:
    knobs = getattr(__import__("triton"), "knobs", None)
    directory = getattr(getattr(knobs, "cache", None), "dir", None)
    return Path(directory or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
