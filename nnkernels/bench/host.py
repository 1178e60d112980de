"""Host time per op call, forward + backward: what an eager training loop pays per layer besides the GPU's time.

Each case runs one op's forward and its backward (`torch.autograd.grad`) on tensors so small that the GPU
finishes every kernel before the host has issued the next: the wall time of many back-to-back calls, with one
synchronisation at the end, is then the host's. nnkernels' op and torch's own run in the same process on the
same tensors, in alternating rounds; the best round of each counts. A row's `ours_ms` and `torch_ms` are host
milliseconds per forward + backward.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .harness import Row, require_gpu

CALLS, ROUNDS, WARMUP = 200, 7, 20


def host_ms(call, synchronize, calls=CALLS, rounds=ROUNDS, warmup=WARMUP) -> float:
    """The best over `rounds` of the wall ms per call of `calls` back-to-back calls, `synchronize()` after each
    round (its wait is spread over the calls: the GPU is idle by then when the host is the limit)."""
    for _ in range(warmup):
        call()
    synchronize()
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize()
        best = min(best, (time.perf_counter() - began) / calls * 1e3)
    return best


def cases(device, dtype):
    """{name: (ours, torch's)}: each a forward + backward of one op on tiny tensors (batch 2, 8x8 planes)."""
    import nnkernels

    def leaf(*shape, **options):
        return torch.randn(*shape, device=device, dtype=options.get("dtype", dtype)).requires_grad_()

    x, x256 = leaf(2, 64, 8, 8), leaf(2, 256, 8, 8)
    x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    w3, w1, wd, ws = leaf(64, 64, 3, 3), leaf(256, 64, 1, 1), leaf(64, 1, 3, 3), leaf(64, 256, 3, 3)
    w3_cl = w3.detach().contiguous(memory_format=torch.channels_last).requires_grad_()  # a model moved to it
    weight, bias = leaf(64, dtype=torch.float32), leaf(64, dtype=torch.float32)
    stats = (torch.zeros(64, device=device), torch.ones(64, device=device))

    def step(op, inputs):
        def call():
            y = op()
            torch.autograd.grad(y, inputs, torch.ones_like(y))
        return call

    def conv(fn, w, **options):
        return step(lambda: fn(x, w, **options), (x, w))

    def batch_norm(fn, training, source=x):
        return step(lambda: fn(source, *stats, weight, bias, training=training), (source, weight, bias))

    return {
        "conv2d 3x3 64->64": (conv(nnkernels.conv2d, w3, padding=1), conv(F.conv2d, w3, padding=1)),
        "conv2d 1x1 64->256": (conv(nnkernels.conv2d, w1), conv(F.conv2d, w1)),
        "conv2d depthwise 3x3 64": (conv(nnkernels.conv2d, wd, padding=1, groups=64),
                                    conv(F.conv2d, wd, padding=1, groups=64)),
        "conv2d 3x3 s2 256->64": (step(lambda: nnkernels.conv2d(x256, ws, stride=2, padding=1), (x256, ws)),
                                  step(lambda: F.conv2d(x256, ws, stride=2, padding=1), (x256, ws))),
        "conv2d 3x3 64->64 channels_last": (step(lambda: nnkernels.conv2d(x_cl, w3, padding=1), (x_cl, w3)),
                                            step(lambda: F.conv2d(x_cl, w3, padding=1), (x_cl, w3))),
        "conv2d 3x3 64->64 channels_last weights": (
            step(lambda: nnkernels.conv2d(x_cl, w3_cl, padding=1), (x_cl, w3_cl)),
            step(lambda: F.conv2d(x_cl, w3_cl, padding=1), (x_cl, w3_cl))),
        "conv2d 1x1 64->256 channels_last": (step(lambda: nnkernels.conv2d(x_cl, w1), (x_cl, w1)),
                                             step(lambda: F.conv2d(x_cl, w1), (x_cl, w1))),
        "batch_norm train": (batch_norm(nnkernels.batch_norm, True), batch_norm(F.batch_norm, True)),
        "batch_norm train channels_last": (batch_norm(nnkernels.batch_norm, True, x_cl),
                                           batch_norm(F.batch_norm, True, x_cl)),
        "batch_norm eval": (batch_norm(nnkernels.batch_norm, False), batch_norm(F.batch_norm, False)),
        "avg_pool2d 3x3 s2 p1": (step(lambda: nnkernels.avg_pool2d(x, 3, 2, 1), (x,)),
                                 step(lambda: F.avg_pool2d(x, 3, 2, 1), (x,))),
    }


def measure(device, dtype, synchronize, quick=False) -> list[Row]:
    """One row per case: nnkernels' and torch's host ms, the best of alternating rounds."""
    rows = []
    rounds = 2 if quick else ROUNDS
    for name, (ours, theirs) in cases(device, dtype).items():
        best = {"ours": float("inf"), "torch": float("inf")}
        for _ in range(rounds):
            best["ours"] = min(best["ours"], host_ms(ours, synchronize, rounds=1))
            best["torch"] = min(best["torch"], host_ms(theirs, synchronize, rounds=1))
        rows.append(Row(suite="host", case=name, dtype=str(dtype).replace("torch.", ""), direction="fwd+bwd",
                        ours_ms=best["ours"], torch_ms=best["torch"], work=0.0, unit="host ms per call",
                        extra={"ours_us": f"{1e3 * best['ours']:.1f}", "torch_us": f"{1e3 * best['torch']:.1f}"}))
    return rows


def run(quick: bool = False) -> list[Row]:
    require_gpu()
    return measure("cuda", torch.bfloat16, torch.cuda.synchronize, quick)
