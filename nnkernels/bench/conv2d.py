"""Benchmark: nnkernels' conv2d against PyTorch/cuDNN (and the seed kernels) on NCHW layers.

`run(quick)` returns one `harness.Row` per (layer, precision, pass): forward is
`nnkernels::conv2d` vs `F.conv2d`; backward (dx + dw) is `nnkernels::conv2d_backward` vs
`aten.convolution_backward`, both timed by `harness.time_ms` (CUDA-graph replay, do_bench
median) in the same process on the same inputs. TFLOP/s counts 2*B*C_OUT*OH*OW*(C_IN/G)*K^2
per pass, twice that for the backward. Precisions: bf16; fp32 with TF32 (cudnn.allow_tf32 =
True, torch's default) and fp32 with TF32 off, set for both sides alike.

The seed kernels (`Conv2dForward`, atomic `Conv2dBackward`) are their own column, `seed_ms`:
they are 10x-1000x slower, so they are timed by CUDA events over a few plain launches (launch
overhead is nothing next to their milliseconds), and only once a call has shown it takes under
`SEED_LIMIT_MS`; the seed has no TF32 mode, so with `quick` it is timed in the bf16 and
fp32-tf32 rows only. Before timing, every kernel a row may use is compiled in parallel worker
processes (Triton's disk cache then serves the timing process), which keeps a run to minutes.

`python3 -m nnkernels.bench.conv2d --out DIR [--quick]` prints the table last and writes
DIR/conv2d.csv and DIR/conv2d.png.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import harness

SEED_LIMIT_MS = 1500.0
WORKERS = 12


@dataclass(frozen=True)
class Layer:
    name: str
    batch: int
    c_in: int
    c_out: int
    size: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    count: int = 1  # how many layers of a network have this shape (bench resnet50_convs weighs by it)

    @property
    def out_size(self):
        return (self.size + 2 * self.padding - self.kernel) // self.stride + 1

    def flops(self):
        return 2 * self.batch * self.c_out * self.out_size**2 * (self.c_in // self.groups) * self.kernel**2


SUITE = [
    Layer("r50 3x3 64 56", 32, 64, 64, 56, 3, 1, 1),
    Layer("r50 3x3 128 28", 32, 128, 128, 28, 3, 1, 1),
    Layer("r50 3x3 256 14", 32, 256, 256, 14, 3, 1, 1),
    Layer("r50 3x3 512 7", 32, 512, 512, 7, 3, 1, 1),
    Layer("r50 1x1 256->64 56", 32, 256, 64, 56, 1, 1, 0),
    Layer("stem 7x7 s2", 32, 3, 64, 224, 7, 2, 3),
    Layer("dw 3x3 256 28", 32, 256, 256, 28, 3, 1, 1, 256),
    Layer("r18 3x3 64 56 B128", 128, 64, 64, 56, 3, 1, 1),
]
# (label, element type, cudnn.allow_tf32)
PRECISIONS = [("bf16", torch.bfloat16, True), ("fp32-tf32", torch.float32, True), ("fp32-ieee", torch.float32, False)]


def layer_tensors(layer, dtype, seed=0):
    """(x, weight, dy) of `layer` in `dtype`, fresh random on the GPU (seeded)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    def make(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)
    x = make(layer.batch, layer.c_in, layer.size, layer.size)
    w = make(layer.c_out, layer.c_in // layer.groups, layer.kernel, layer.kernel)
    dy = make(layer.batch, layer.c_out, layer.out_size, layer.out_size)
    return x, w, dy


def _conv_args(layer):
    return [layer.stride] * 2, [layer.padding] * 2, [1, 1], layer.groups


def _seed_launchers(layer, x, w, dy):
    from ..ops.conv2d.seed import Conv2dBackward, Conv2dForward

    constants = (layer.kernel, layer.kernel, layer.stride, layer.stride, layer.padding, layer.padding, layer.groups, 64)
    sizes = (layer.batch, layer.c_in, layer.c_out, layer.size, layer.size, layer.out_size, layer.out_size)
    forward, backward = Conv2dForward(*constants, dtype=x.dtype), Conv2dBackward(*constants, dtype=x.dtype)
    y, dx, dw = torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)

    def seed_forward():
        forward.launch(x, w, y, *sizes)

    def seed_backward():
        dx.zero_()
        dw.zero_()
        backward.launch(dy, x, w, dx, dw, *sizes)

    return seed_forward, seed_backward


def _compile_worker(layer, dtype_name, tf32, quick, seed):
    """In a worker process: compile (by launching once) every kernel the row may use; time nothing."""
    os.environ["NNKERNELS_TUNE"] = "off"
    from ..functional.conv import precompile

    torch.backends.cudnn.allow_tf32 = tf32
    x, w, dy = layer_tensors(layer, getattr(torch, dtype_name))
    stride, padding, dilation, groups = _conv_args(layer)
    precompile(x, w, stride, padding, dilation, groups, full=not quick)
    for seed_launch in _seed_launchers(layer, x, w, dy) if seed else ():
        seed_launch()
    torch.cuda.synchronize()
    return layer.name


def _precompile_all(quick, layers, precisions, seed):
    jobs = [(layer, str(dtype).split(".")[-1], tf32) for layer in layers for _, dtype, tf32 in precisions]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
        for future in [pool.submit(_compile_worker, *job, quick, seed) for job in jobs]:
            future.result()


def _seed_ms(fn):
    """ms of one seed call (events, after one compiling call), or None when a call exceeds SEED_LIMIT_MS."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if times[-1] > SEED_LIMIT_MS:
            return None
    return sorted(times)[1]


def _row(layer, label, direction, ours, reference, seed, work):
    extra = {}
    if seed is not None:
        ms = _seed_ms(seed)
        extra["seed_ms"] = f"{ms:.3f}" if ms is not None else f"skipped(>{SEED_LIMIT_MS:.0f}ms/call)"
    ours_ms, torch_ms = harness.time_ms(ours), harness.time_ms(reference)
    return harness.Row("conv2d", layer.name, label, direction, ours_ms, torch_ms, work, "TFLOP/s", extra)


def run(quick: bool = False, layers=None, precisions=None, seed: bool = True, suite=SUITE) -> list[harness.Row]:
    """The issue-3 suite, or `suite` (module docstring); `quick` tunes over the quick config set and
    times the seed only where its precision differs. `layers` / `precisions` (names) pick a subset;
    `seed=False` leaves the seed column out."""
    harness.require_gpu()
    layers = [layer for layer in suite if layers is None or layer.name in layers]
    precisions = [p for p in PRECISIONS if precisions is None or p[0] in precisions]
    os.environ["NNKERNELS_TUNE"] = "quick" if quick else "full"
    from .. import functional  # noqa: F401
    from ..functional import conv2d as _register  # noqa: F401  (registers torch.ops.nnkernels.conv2d*)

    _precompile_all(quick, layers, precisions, seed)
    rows = []
    previous_tf32 = torch.backends.cudnn.allow_tf32
    try:
        for label, dtype, tf32 in precisions:
            torch.backends.cudnn.allow_tf32 = tf32
            for layer in layers:
                x, w, dy = layer_tensors(layer, dtype)
                stride, padding, dilation, groups = _conv_args(layer)
                timed_seed = seed and not (quick and label == "fp32-ieee")
                seeds = _seed_launchers(layer, x, w, dy) if timed_seed else (None, None)
                rows.append(_row(
                    layer, label, "forward",
                    lambda: torch.ops.nnkernels.conv2d(x, w, None, stride, padding, dilation, groups),
                    lambda: torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups),
                    seeds[0], layer.flops(),
                ))
                rows.append(_row(
                    layer, label, "backward",
                    lambda: torch.ops.nnkernels.conv2d_backward(dy, x, w, stride, padding, dilation, groups,
                                                                True, True, False),
                    lambda: torch.ops.aten.convolution_backward(dy, x, w, None, stride, padding, dilation, False,
                                                                [0, 0], groups, [True, True, False]),
                    seeds[1], 2 * layer.flops(),
                ))
                print("\n".join(harness.table(rows[-2:], "").splitlines()[3:-1]), flush=True)
    finally:
        torch.backends.cudnn.allow_tf32 = previous_tf32
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m nnkernels.bench.conv2d", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for conv2d.csv and conv2d.png")
    parser.add_argument("--quick", action="store_true", help="quick tuning; seed timed in fewer rows")
    parser.add_argument("--layers", help="comma-separated layer names (default: the whole suite)")
    parser.add_argument("--precisions", help="comma-separated: bf16, fp32-tf32, fp32-ieee (default: all)")
    parser.add_argument("--no-seed", action="store_true", help="leave the seed kernels' column out")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick, layers=args.layers.split(",") if args.layers else None,
               precisions=args.precisions.split(",") if args.precisions else None, seed=not args.no_seed)
    print(summary(rows))
    print(harness.report(rows, args.out, "conv2d", "conv2d: nnkernels vs PyTorch/cuDNN, NCHW"))


def summary(rows) -> str:
    """Geometric-mean speed-up per precision and pass, and the slowest row of each."""
    lines = []
    for label, _, _ in PRECISIONS:
        for direction in ("forward", "backward"):
            chosen = [r for r in rows if r.dtype == label and r.direction == direction]
            if chosen:
                worst = min(chosen, key=lambda r: r.speedup)
                lines.append(f"{label:9} {direction:8} geomean {harness.geomean(r.speedup for r in chosen):.3f}x  "
                             f"slowest {worst.speedup:.2f}x ({worst.case})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
