"""The host floor of an op call on the GPU (BENCHMARKS.md, "Host time per op call"): µs per call of what a call
is made of, each called back to back, the best of 5 rounds of 2000 calls.

    PYTHONPATH=. python3 tools/host_floor.py     # on the GPU
"""
import time

import torch

from host_profile import NoopFunction

from nnkernels.launcher import Launcher
from nnkernels.ops.avg_pool2d.channels_last import AvgPool2dClForward, avg_pool2d_cl_forward

ROUNDS, CALLS = 5, 2000


def best_us(call) -> float:
    for _ in range(200):  # warm-up
        call()
    best = float("inf")
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(CALLS):
            call()
        best = min(best, (time.perf_counter() - began) / CALLS * 1e6)
    torch.cuda.synchronize()
    return best


def main():
    # A small channels-last pooling: its kernel runs in a few µs, so the host never waits for the GPU.
    x, y = torch.randn(2, 8, 8, 64, device="cuda"), torch.empty(2, 4, 4, 64, device="cuda")
    sizes = (2, 64, 8, 8, 4, 4)
    kernel = AvgPool2dClForward(2, 2, 2, 2, 0, 0, True, 0, True, 32, 64, 1, dtype=torch.float32)
    launch = Launcher(kernel)
    t = torch.randn(2, 64, 8, 8, device="cuda", requires_grad=True)
    pieces = {
        "a launch through a plan's Launcher": lambda: launch(x, y, *sizes),
        "a kernel object's checked launch": lambda: kernel.launch(x, y, *sizes),
        "a Triton JIT call": lambda: avg_pool2d_cl_forward[(1, 1, 1)](x, y, *sizes, 2, 2, 2, 2, 0, 0, True, 0, True,
                                                                     32, 64),
        "torch.empty 2x64x8x8": lambda: torch.empty(2, 64, 8, 8, device="cuda"),
        "torch neg (an allocation and a launch)": lambda: x.neg(),
        "t.permute(0, 2, 3, 1).contiguous()": lambda: t.detach().permute(0, 2, 3, 1).contiguous(),
        "autograd.grad through a no-op Function": lambda: torch.autograd.grad(NoopFunction.apply(t), t, t),
        "autograd.grad through torch's neg": lambda: torch.autograd.grad(t.neg(), t, t),
    }
    for name, call in pieces.items():
        print(f"{name:42s} {best_us(call):7.2f} µs", flush=True)


if __name__ == "__main__":
    main()
