"""Depthwise tiles swept: the forward, dx and dw (+ reduce) of nnkernels.conv2d under each tile
configuration, against cuDNN's grouped convolution, on the issue-3 suite's depthwise layer and
MobileNetV2's (B32). The tables in BENCHMARKS.md's depthwise section come from a scratch form of
this script.

    PYTHONPATH=. python3 tools/depthwise_sweep.py [--dtype bfloat16] [--layers "suite 256@28,mbv2 144@56"]

A configuration is (lanes, band, warps, gather): (plane, column) pairs per program, the longest
band of rows, warps per program, and whether the forward and dw may load a row once and shift it
across lanes (`gather_columns_fit`). The first is the library's. Needs a GPU.
"""
import argparse
import contextlib
import dataclasses
import importlib

import torch

from nnkernels import tuning
from nnkernels.bench import harness

plan = importlib.import_module("nnkernels.functional.conv2d_plan")  # where conv2d reads gather_columns_fit
LAYERS = {  # name: (B, C, size, stride), 3x3, padding 1
    "suite 256@28": (32, 256, 28, 1),
    "mbv2 32@112": (32, 32, 112, 1),
    "mbv2 144@56": (32, 144, 56, 1),
    "mbv2 144@56 s2": (32, 144, 56, 2),
    "mbv2 384@14": (32, 384, 14, 1),
    "mbv2 960@7": (32, 960, 7, 1),
    "odd 40@29 s2": (6, 40, 29, 2),
}
CONFIGS = [(tuning.DEPTHWISE_LANES, tuning.DEPTHWISE_BAND, 4, True), (128, 16, 4, False), (128, 8, 4, True),
           (128, 32, 4, True), (256, 16, 8, True), (64, 16, 2, True)]


@contextlib.contextmanager
def tiles(lanes, band, warps, gather):
    """The depthwise kernels' tiles under (lanes, band, warps, gather) inside the block; as before after."""
    saved = tuning.DEPTHWISE_LANES, tuning.DEPTHWISE_BAND, tuning.depthwise_tile, plan.gather_columns_fit
    heuristic = tuning.depthwise_tile
    tuning.DEPTHWISE_LANES, tuning.DEPTHWISE_BAND = lanes, band
    tuning.depthwise_tile = lambda *args, **kwargs: dataclasses.replace(heuristic(*args, **kwargs), num_warps=warps)
    plan.gather_columns_fit = saved[3] if gather else (lambda *args: False)
    try:
        yield
    finally:
        tuning.DEPTHWISE_LANES, tuning.DEPTHWISE_BAND, tuning.depthwise_tile, plan.gather_columns_fit = saved


def row(name, config, dtype):
    """One line: our fwd / dx / dw / bwd µs, cuDNN's fwd / bwd µs, and the two speed-ups."""
    B, C, size, stride = LAYERS[name]
    out = (size + 2 - 3) // stride + 1
    x, dy = (torch.randn(B, C, n, n, device="cuda", dtype=dtype) for n in (size, out))
    w = torch.randn(C, 1, 3, 3, device="cuda", dtype=dtype)
    args = ((stride, stride), (1, 1), (1, 1), C)
    with tiles(*config):
        ours = {
            "fwd": lambda: torch.ops.nnkernels.conv2d(x, w, None, *args),
            "dx": lambda: torch.ops.nnkernels.conv2d_backward(dy, x, w, *args, True, False, False),
            "dw": lambda: torch.ops.nnkernels.conv2d_backward(dy, x, w, *args, False, True, False),
            "bwd": lambda: torch.ops.nnkernels.conv2d_backward(dy, x, w, *args, True, True, False),
        }
        us = {k: harness.time_ms(fn) * 1e3 for k, fn in ours.items()}
    torch_fwd = harness.time_ms(lambda: torch.nn.functional.conv2d(x, w, None, *args)) * 1e3
    torch_bwd = harness.time_ms(lambda: torch.ops.aten.convolution_backward(
        dy, x, w, None, *args[:3], False, [0, 0], C, [True, True, False])) * 1e3
    lanes, band, warps, gather = config
    return (f"{name:16} {lanes:4} r{band:<3} w{warps} g{int(gather)} | fwd {us['fwd']:7.1f} dx {us['dx']:7.1f} "
            f"dw {us['dw']:7.1f} bwd {us['bwd']:7.1f} | cuDNN fwd {torch_fwd:7.1f} bwd {torch_bwd:7.1f} | "
            f"{torch_fwd / us['fwd']:.2f}x {torch_bwd / us['bwd']:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--layers", help=f"comma-separated, of: {', '.join(LAYERS)} (default: all)")
    args = parser.parse_args()
    harness.require_gpu()
    names = args.layers.split(",") if args.layers else list(LAYERS)
    unknown = [name for name in names if name not in LAYERS]
    if unknown:
        raise SystemExit(f"--layers: expected names of {', '.join(LAYERS)}, got {', '.join(unknown)}")
    print(harness.environment())
    for name in names:
        for config in CONFIGS:
            print(row(name, config, getattr(torch, args.dtype)), flush=True)


if __name__ == "__main__":
    main()
