"""`warmup(model, example_inputs)`: compile and tune, ahead of training, everything a training step needs.

Each nnkernels op builds a plan on the first call with a new signature (shapes, strides, dtypes, device, flags):
that is where kernels compile and, on the GPU, configs are timed. `warmup` runs one forward (and backward) of a
copy of the model on the example inputs, so every plan of a step exists before the first real one; the model
itself is left untouched (no running statistics updated, no gradients). Run it under the same
`torch.autocast` as the training step, so that it sees the same dtypes.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch


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


def warmup(model: torch.nn.Module, example_inputs, *, backward: bool = True, progress: bool = True) -> WarmupSummary:
    """Run one training step's forward (and, with `backward`, its backward) of a copy of `model` on
    `example_inputs` (a tensor or a tuple of positional arguments), with a progress bar over its nnkernels layers;
    return a summary. A bad example input raises the error the model itself would raise."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    twin = copy.deepcopy(model).train(model.training)
    layers = _nnkernels_layers(twin)
    began = time.perf_counter()
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
    return WarmupSummary(len(layers), time.perf_counter() - began, loss is not None)
