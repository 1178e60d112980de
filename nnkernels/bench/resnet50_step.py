"""End-to-end training step of torchvision's ResNet-50: converted to nnkernels layers vs unconverted.

One step = forward + backward + SGD (momentum) step, batch 64, 224x224, NCHW, bf16 autocast,
both models in the same process on the same data. Timed with the harness, as CUDA-graph
replays when the whole step captures (it does when no op syncs the host), else eagerly; the
row's `graph` column says which. Rounds alternate ours/torch and the medians are taken.
"""
from __future__ import annotations

import copy
import math
import statistics
import sys

import torch

from .harness import Row, require_gpu, time_ms

BATCH, IMAGE_SIZE, NUM_CLASSES = 64, 224, 1000
# Forward multiply-adds of ResNet-50 at 224x224: 4.09 G per image; training is ~3x the forward.
TRAIN_FLOPS_PER_IMAGE = 3 * 2 * 4.09e9


def make_step(model, images, labels):
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        # The autocast cache must be off for a step that is captured in a CUDA graph.
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimiser.step()
        # Zeroing in place keeps the gradients at fixed addresses, as graph replays need.
        optimiser.zero_grad(set_to_none=False)

    return step


def timed(step, graph: bool) -> float:
    try:
        return time_ms(step, graph=graph)
    except Exception as err:  # a step that cannot be captured is only timed eagerly
        if not graph:
            raise
        print(f"resnet50_step: CUDA-graph capture failed ({type(err).__name__}: {err}); eager rows only",
              file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def run(quick: bool = False) -> list[Row]:
    require_gpu()
    import torchvision

    from ..nn import convert

    torch.manual_seed(0)
    reference = torchvision.models.resnet50().cuda()
    ours = convert(copy.deepcopy(reference))
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).cuda()
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator).cuda()
    steps = {"ours": make_step(ours, images, labels), "torch": make_step(reference, images, labels)}
    rows = []
    for graph in (True, False):
        times = {"ours": [], "torch": []}
        for _ in range(1 if quick else 3):
            for side, step in steps.items():
                times[side].append(timed(step, graph))
        ours_ms, torch_ms = statistics.median(times["ours"]), statistics.median(times["torch"])
        if graph and (math.isnan(ours_ms) or math.isnan(torch_ms)):  # one side did not capture
            continue
        rows.append(Row(
            suite="resnet50_step",
            case=f"resnet50 B{BATCH} {IMAGE_SIZE}px NCHW step {'graph' if graph else 'eager'}",
            dtype="bf16-autocast",
            direction="train-step",
            ours_ms=ours_ms,
            torch_ms=torch_ms,
            work=BATCH * TRAIN_FLOPS_PER_IMAGE,
            unit="TFLOP/s",
            extra={"graph": graph, "rounds": len(times["ours"])},
        ))
    return rows
