"""Python time on the host per op call, forward + backward, with every Triton launch stubbed out: what an
eager training loop pays per layer besides the GPU's time (a CUDA-graph replay pays none of it).

    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/host_overhead.py [--interpreter] [--profile OP]

Runs on the CPU. By default it takes a compiled process's tuning path on a 132-SM GPU whose choices are
all remembered (the GPU's candidate lists, every `tuning.choose` after the first call a hit in its store),
which is what a training loop runs after its first step; `--interpreter` takes the interpreter's path
instead. Shapes are ResNet-50's (batch 32, 128 channels, 28x28 planes), on uninitialised CPU tensors that
no kernel touches. The last row is the floor under all of them: a pair of custom ops that do nothing,
torch's dispatch alone. Prints the best of 9 rounds of 40 calls per op, in ms; `--profile OP` adds
cProfile's top entries for OP.
"""
import argparse
import cProfile
import functools
import importlib
import os
import pstats
import tempfile
import time

import torch

import nnkernels
from nnkernels import tuning
from nnkernels.kernel import catalogue

avg_pool2d = importlib.import_module("nnkernels.functional.avg_pool2d")  # the modules, not the ops they export
batch_norm = importlib.import_module("nnkernels.functional.batch_norm")

ROUNDS, CALLS = 9, 40


class _NoLaunch:
    """Stands in for a kernel's Triton runner: `runner[grid](*args, **options)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


def stub_launches(set_attribute=setattr):
    """Every kernel class launches nothing (`set_attribute`: pytest's monkeypatch.setattr in tests)."""
    for kernel_class in catalogue():
        set_attribute(kernel_class, "_runner", _NoLaunch())


def gpu_path(set_attribute=setattr):
    """Tuning as in a compiled process on a 132-SM GPU, every timing equal (its store: NNKERNELS_CACHE_DIR):
    the GPU's candidate lists for convolution, pooling and batch norm's split passes. The rest of what
    depends on the mode (batch norm's tile plans, say) stays the interpreter's."""
    set_attribute(tuning, "INTERPRETED", False)
    set_attribute(avg_pool2d, "lanes_candidates", functools.partial(avg_pool2d.lanes_candidates, gpu=True))
    set_attribute(batch_norm, "split_candidates", functools.partial(batch_norm.split_candidates, gpu=True))
    set_attribute(tuning, "_num_sms", lambda: 132)
    set_attribute(tuning, "_time_ms", lambda run, config: 1.0)
    set_attribute(tuning, "_memory", None)
    set_attribute(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch cannot ask


def custom_op_pair():
    """A forward + backward through two `torch.library` custom ops (autograd registered) that do no work:
    torch's dispatch alone, which every nnkernels op pays under its own Python (registered once per process)."""
    if not hasattr(torch.ops.host_overhead, "nothing"):
        @torch.library.custom_op("host_overhead::nothing", mutates_args=())
        def nothing(x: torch.Tensor, w: torch.Tensor, stride: list[int]) -> torch.Tensor:
            return torch.empty_like(x)

        @torch.library.custom_op("host_overhead::nothing_backward", mutates_args=())
        def nothing_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                             stride: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.empty_like(x), torch.empty_like(w)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], inputs[1])
            ctx.stride = inputs[2]

        def backward(ctx, dy):
            return (*nothing_backward(dy, *ctx.saved_tensors, ctx.stride), None)

        nothing.register_autograd(backward, setup_context=setup_context)
    x, w = torch.empty(32, 128, 28, 28, requires_grad=True), torch.empty(128, 128, 3, 3, requires_grad=True)
    dy = torch.empty(32, 128, 28, 28)
    return lambda: torch.autograd.grad(torch.ops.host_overhead.nothing(x, w, [1, 1]), (x, w), dy)


def ops():
    """{name: one forward + backward call}, each on ResNet-50-sized tensors."""
    x = torch.empty(32, 128, 28, 28, requires_grad=True)
    w3, w1 = torch.empty(128, 128, 3, 3, requires_grad=True), torch.empty(64, 128, 1, 1, requires_grad=True)
    weight, bias = torch.ones(128, requires_grad=True), torch.zeros(128, requires_grad=True)
    running_mean, running_var = torch.zeros(128), torch.ones(128)
    dy, dy1, dy_pool = torch.empty(32, 128, 28, 28), torch.empty(32, 64, 28, 28), torch.empty(32, 128, 14, 14)
    return {
        "conv2d 3x3": lambda: torch.autograd.grad(nnkernels.conv2d(x, w3, None, 1, 1), (x, w3), dy),
        "conv2d 1x1": lambda: torch.autograd.grad(nnkernels.conv2d(x, w1), (x, w1), dy1),
        "batch_norm train": lambda: torch.autograd.grad(
            nnkernels.batch_norm(x, running_mean, running_var, weight, bias, training=True), (x, weight, bias), dy),
        "avg_pool2d 3x3 s2": lambda: torch.autograd.grad(nnkernels.avg_pool2d(x, 3, 2, 1), (x,), dy_pool),
        "custom ops, no work": custom_op_pair(),
    }


def best_ms(call) -> float:
    for _ in range(10):  # the first calls tune (on the GPU path) and fill caches
        call()
    best = float("inf")
    for _ in range(ROUNDS):
        began = time.perf_counter()
        for _ in range(CALLS):
            call()
        best = min(best, (time.perf_counter() - began) / CALLS * 1e3)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpreter", action="store_true", help="the interpreter's code path")
    parser.add_argument("--profile", metavar="OP", help="cProfile one op (a name the table prints)")
    args = parser.parse_args(argv)
    stub_launches()
    if not args.interpreter:
        os.environ["NNKERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="nnkernels-host-overhead-")
        gpu_path()
    calls = ops()
    lines = [f"{name:19} {best_ms(call):.3f} ms per forward + backward" for name, call in calls.items()]
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [calls[args.profile]() for _ in range(CALLS)])
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
