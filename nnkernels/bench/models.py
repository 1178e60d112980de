"""Whole training steps of torchvision models, every way a user runs them, nnkernels beside torch.

One step = forward + backward + SGD (momentum) step on random weights and data, batch 64, 224x224, bf16
autocast, `cudnn.benchmark` on. Per model, in one process, on the same data:
- torch eager NCHW, torch eager channels_last, torch from a hand-captured CUDA graph, torch.compile (default);
- nnkernels (`convert(model)`, NCHW) eager, from a hand-captured CUDA graph, torch.compile default and
  mode="reduce-overhead" (torch's own CUDA graphs).
ms per step are medians of `triton.testing.do_bench` (eager and compiled steps called as a loop calls them;
graphs replayed). Each way's first step is timed on its own (compilation and tuning included, in a process
whose caches earlier ways may have warmed), and the peak memory of its steps read. torchvision is an optional
dependency of the benchmarks (`pip install nnkernels[bench]`).

    nnkernels bench models [MODEL...]
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .harness import Row, require_gpu, time_ms

MODELS = ("resnet50", "densenet121", "mobilenet_v2", "efficientnet_b0", "resnext50_32x4d")
BATCH, IMAGE_SIZE, NUM_CLASSES = 64, 224, 1000
# Ways to run a step: (name, whose model, how). Rows pair each of ours with torch's counterpart.
WAYS = ("torch eager", "torch eager channels_last", "torch graph", "torch compile", "ours eager", "ours graph",
        "ours compile", "ours compile reduce-overhead")
PAIRS = (("ours eager", "torch eager", "eager"), ("ours eager", "torch eager channels_last", "eager vs channels_last"),
         ("ours graph", "torch graph", "CUDA graph"), ("ours compile", "torch compile", "torch.compile"),
         ("ours compile reduce-overhead", "ours graph", "reduce-overhead vs our hand-captured graph"))


def make_step(model, images, labels, *, graph=False, mark_steps=False):
    """One training step: forward under bf16 autocast, backward, SGD with momentum. For a captured graph the
    autocast cache is off and the gradients are zeroed in place (fixed addresses); `mark_steps` tells torch's
    CUDA-graph trees (reduce-overhead) where each step begins."""
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graph):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=not graph)

    return step


def _model(name):
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).cuda()


def _setups(name, ways, images, labels):
    """{way: (step, graph?)} for the ways asked, each on its own copy of the same initial model."""
    from .. import convert

    reference = _model(name)
    channels_last = images.to(memory_format=torch.channels_last)
    make = {
        "torch eager": lambda: make_step(copy.deepcopy(reference), images, labels),
        "torch eager channels_last": lambda: make_step(
            copy.deepcopy(reference).to(memory_format=torch.channels_last), channels_last, labels),
        "torch graph": lambda: make_step(copy.deepcopy(reference), images, labels, graph=True),
        "torch compile": lambda: make_step(torch.compile(copy.deepcopy(reference)), images, labels),
        "ours eager": lambda: make_step(convert(copy.deepcopy(reference)), images, labels),
        "ours graph": lambda: make_step(convert(copy.deepcopy(reference)), images, labels, graph=True),
        "ours compile": lambda: make_step(torch.compile(convert(copy.deepcopy(reference))), images, labels),
        "ours compile reduce-overhead": lambda: make_step(
            torch.compile(convert(copy.deepcopy(reference)), mode="reduce-overhead"), images, labels, mark_steps=True),
    }
    return {way: (make[way], "graph" in way and "reduce" not in way) for way in ways}


def measure_way(make, graph, rounds=3):
    """(ms per step, seconds of the first step, peak GiB of the steps) of one way."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    step = make()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - began
    torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(time_ms(step, graph=graph) for _ in range(rounds))
    return ms, first_s, torch.cuda.max_memory_allocated() / 2**30


def measure(models=MODELS, ways=WAYS, rounds=3, on_result=None) -> dict:
    """{(model, way): (ms, first step s, peak GiB)}; `on_result(model, way, result)` after each."""
    torch.backends.cudnn.benchmark = True  # torch at its best: cuDNN times its algorithms per shape
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).cuda()
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator).cuda()
    results = {}
    for model in models:
        for way, (make, graph) in _setups(model, ways, images, labels).items():
            results[model, way] = measure_way(make, graph, rounds)
            if on_result is not None:
                on_result(model, way, results[model, way])
            torch.compiler.reset()
    return results


def rows(results) -> list[Row]:
    out = []
    for model in dict.fromkeys(model for model, _ in results):
        for ours, theirs, label in PAIRS:
            if (model, ours) not in results or (model, theirs) not in results:
                continue
            (ours_ms, ours_first, ours_gib), (theirs_ms, theirs_first, theirs_gib) = results[model, ours], results[
                model, theirs]
            out.append(Row(suite="models", case=f"{model} {label}", dtype="bf16-autocast", direction="train-step",
                           ours_ms=ours_ms, torch_ms=theirs_ms, work=0.0, unit="ms per step",
                           extra={"first_step_s": f"{ours_first:.1f}/{theirs_first:.1f}",
                                  "peak_gib": f"{ours_gib:.2f}/{theirs_gib:.2f}"}))
    return out


def run(quick: bool = False, models=MODELS, ways=WAYS) -> list[Row]:
    require_gpu()
    return rows(measure(models, ways, rounds=1 if quick else 3))
