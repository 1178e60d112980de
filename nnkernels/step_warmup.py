"""`warmup(model, example_inputs)`: compile and tune, ahead of training, everything a training step needs.

Each nnkernels op builds a plan on the first call with a new signature (shapes, strides, dtypes, device, flags):
that is where kernels compile and, on the GPU, configs are timed. `warmup` runs one forward (and backward) of a
copy of the model on the example inputs, so every plan of a step exists before the first real one; the model itself
is left untouched (no running statistics updated, no gradients). Run it under the same `torch.autocast` as the
training step, so that it sees the same dtypes. On compiled GPUs the kernels of its convolutions, batch norms and
average poolings are compiled ahead in `jobs` background processes (`parallel_compile`; by default one per CPU, at
most 8, or `NNKERNELS_COMPILE_JOBS`), their shapes taken from a forward pass on the meta device, each layer's
forward in the order of the step and then its backward in reverse, while the step runs and loads what they have
compiled; when the step is done they are stopped. Where they fail, warmup says so in one line and the step compiles
what they did not. `jobs=1` compiles as the step runs, one kernel after another.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch

from . import compile_ahead
from ._mode import INTERPRETED

log = logging.getLogger("nnkernels")


@dataclass
class WarmupSummary:
    """What `warmup` did: the nnkernels layers run, the seconds it took, and whether the backward ran."""

    layers: int
    seconds: float
    backward: bool

    def __str__(self):
        passes = "forward and backward" if self.backward else "forward"
        return f"nnkernels.warmup: {self.layers} nnkernels layers, {passes}, {self.seconds:.1f} s"


def _nnkernels_layers(model):
    from . import nn

    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.AvgPool2d, nn.BatchNorm2d))]


def _scalar(output):
    """A float sum over every floating tensor of `output` (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.is_floating_point() and output.requires_grad else None
    parts = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    sums = [s for s in (_scalar(part) for part in parts) if s is not None]
    return sum(sums) if sums else None


def _conv_dtype(model, inputs) -> torch.dtype:
    """The dtype the model's convolutions compute in: autocast's where it is on for the inputs' device, else that
    of the model's first floating parameter."""
    device_type = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cuda")
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def shapes_of_step(model, inputs) -> list:
    """The layer shapes (`layer_calls`: convolutions, batch norms, average poolings) one forward + backward of
    `model` on `inputs` runs, in the order of the forward, from a pass of a meta copy of `model` (`meta_copy`)."""
    from .layer_calls import layer_shapes, meta_copy

    return list(layer_shapes(meta_copy(model), inputs, training=model.training))


def start_compiling_shapes(shapes, dtype, jobs: int, device: str, who: str):
    """Start compiling the kernels of `shapes` in `jobs` background processes: the `parallel_compile.Precompiling`
    handle, or None after one warning line from `who` where they could not start (the step then compiles as it
    goes)."""
    from .parallel_compile import start_precompile

    try:
        return start_precompile(shapes, dtype, jobs, device)
    except Exception as error:  # noqa: BLE001  (the step that follows compiles what this did not)
        log.warning("%s: compiling in %d processes failed (%s: %s); compiling as the step runs", who, jobs,
                    type(error).__name__, _first_line(str(error)))
        return None


def start_compiling_layers(model, inputs, jobs: int, who: str = "nnkernels.warmup"):
    """`start_compiling_shapes` of every layer one forward + backward of `model` on `inputs` runs."""
    try:
        shapes = shapes_of_step(model, inputs)
    except Exception as error:  # noqa: BLE001  (the step itself raises what the model raises)
        log.warning("%s: the layers of a step could not be found on the meta device (%s: %s); compiling as "
                    "the step runs", who, type(error).__name__, _first_line(str(error)))
        return None
    device = next((str(t.device) for t in inputs if isinstance(t, torch.Tensor)), "cuda")
    return start_compiling_shapes(shapes, _conv_dtype(model, inputs), jobs, device, who)


def _stop(compiling, who: str = "nnkernels.warmup"):
    """End the background compilation; a worker's failure is one warning line (the step compiled it itself)."""
    compiling.stop()
    if compiling.failures:
        log.warning("%s: compiling ahead failed for %d of %d jobs (%s); the step compiled those itself", who,
                    len(compiling.failures), len(compiling.jobs), _first_line(compiling.failures[0]))


def warmup(model: torch.nn.Module, example_inputs, *, backward: bool = True, progress: bool = True,
           jobs: int | None = None) -> WarmupSummary:
    """Run one training step's forward (and, with `backward`, its backward) of a copy of `model` on
    `example_inputs` (a tensor or a tuple of positional arguments), with a progress bar over its nnkernels layers;
    return a summary. `jobs` > 1: meanwhile compile the layers' kernels in that many processes (on compiled
    GPUs; the interpreter has nothing to compile); None: `compile_ahead.background_jobs()`. A bad example input raises the
    error the model itself would raise."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if jobs is not None and (type(jobs) is not int or jobs < 1):
        raise ValueError(f"jobs: expected an int >= 1 or None, got {jobs!r}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if jobs is None:
        jobs = compile_ahead.background_jobs()
    began = time.perf_counter()
    with compile_ahead.suppressed():  # the twin's hook would start what this starts
        compiling = start_compiling_layers(model, inputs, jobs) if jobs > 1 and not INTERPRETED else None
        try:
            layers, backward_ran = _run_twin(model, inputs, backward, progress)
        finally:
            if compiling is not None:
                _stop(compiling)
    compile_ahead.mark_done(model)
    return WarmupSummary(layers, time.perf_counter() - began, backward_ran)


def _run_twin(model, inputs, backward, progress) -> tuple[int, bool]:
    """One forward (and backward) of a copy of `model`, with the progress bar: (its nnkernels layers, whether the
    backward ran)."""
    twin = copy.deepcopy(model).train(model.training)
    layers = _nnkernels_layers(twin)
    bar, task, hooks = None, None, []
    if progress and layers:
        from rich.console import Console
        from rich.progress import Progress

        console = Console()
        # Off where the output is not a terminal: there the bar would only leave an empty line behind.
        bar = Progress(transient=True, console=console, disable=not console.is_terminal)
        # One step per layer's forward, then the backward as one (hooks inside it would clash with in-place ops).
        task = bar.add_task("nnkernels: compiling and tuning", total=len(layers) + (1 if backward else 0))
        hooks = [layer.register_forward_hook(lambda *_: bar.advance(task)) for layer in layers]
        bar.start()
    try:
        output = twin(*inputs)
        loss = _scalar(output) if backward else None
        if loss is not None:
            loss.backward()
            if bar is not None:
                bar.advance(task)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
        if bar is not None:
            bar.stop()
    return len(layers), loss is not None
