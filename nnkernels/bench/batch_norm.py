"""Benchmark: nnkernels' batch norm vs PyTorch (and the seed kernels where they apply).

N = numel(x), e = element size. Bytes the pass must move (per-channel vectors neglected):
eval forward 2Ne (read x, write y); eval backward 3Ne (read dy, x; write dx);
train forward 3Ne (x read twice: statistics, then normalise; write y);
train backward 5Ne (dy and x read twice: reductions, then dx; write dx);
a channel that fits on chip (one tile, B32 C2048 7x7) is read once: train 2Ne forward, 3Ne backward.
Timed in CUDA graphs: forward through the functional call (the training forward includes the
running-statistics update on both sides); backward as the op each autograd formula calls
(ours: nnkernels::batch_norm_*_backward; PyTorch: aten._batch_norm_impl_index_backward, cuDNN where
it picks it).
Run: python3 -m nnkernels.bench.batch_norm --out DIR [--quick] [--case 7x7]
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import harness
from ..functional import batchnorm as bn
from ..functional.batchnorm_algorithms import fits_one_tile
from ..machine import machine_of
from ..ops.batch_norm.seed import BatchNorm2dNchwBackward, BatchNorm2dNchwForwardInference

BYTES_FORMULA = ("bytes: eval fwd 2Ne, eval bwd 3Ne, train fwd 3Ne, train bwd 5Ne (2Ne/3Ne when a channel fits "
                 "one tile); N = numel(x), e = elem size; floor = bytes / 4.27 TB/s; "
                 "of_copy = same-size copy time / ours")
SUITE = (("B32 C256 56x56", (32, 256, 56, 56)), ("B256 C64 112x112", (256, 64, 112, 112)),
         ("B32 C2048 7x7", (32, 2048, 7, 7)))
DTYPES = (torch.float32, torch.bfloat16)


def _passes(mode, direction, fused):
    """How many N-element tensors the pass moves (see the module docstring)."""
    if mode == "eval":
        return 2 if direction == "forward" else 3
    if direction == "forward":
        return 2 if fused else 3
    return 3 if fused else 5


def _seed_ms(direction, x, dy, weight, bias, running_mean, running_var, eps=1e-5):
    """The seed's frozen-statistics kernels, with every per-channel tensor in x's dtype as they take it."""
    B, C, H, W = x.shape
    w, b, rm, rv = (t.to(x.dtype) for t in (weight, bias, running_mean, running_var))
    out = torch.empty_like(x)
    if direction == "forward":
        seed = BatchNorm2dNchwForwardInference(1024, dtype=x.dtype)
        return harness.time_ms(lambda: seed.launch(x, out, w, b, rm, rv, C, H * W, eps))
    seed = BatchNorm2dNchwBackward(1024, dtype=x.dtype)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    return harness.time_ms(lambda: seed.launch(dy, x, out, w, rm, rv, dw, db, B, C, H * W, eps))


def _backward_calls(x, dy, weight, bias, running_mean, running_var, training):
    """(ours, PyTorch's) backward alone, each what its autograd formula calls, on saved statistics.
    PyTorch's side is aten._batch_norm_impl_index_backward, which picks cuDNN or its native kernel."""
    if training:
        _, mean, rstd, _ = bn.batch_norm_train_op(x, weight, bias, 1e-5)
        ours = functools.partial(bn.batch_norm_train_backward_op, dy, x, weight, mean, rstd)
        stats = running_mean.clone(), running_var.clone()
    else:
        ours = functools.partial(bn.batch_norm_eval_backward_op, dy, x, running_mean, running_var, weight, 1e-5)
        stats = running_mean, running_var
    _, save_mean, save_var, reserve, impl = torch.ops.aten._batch_norm_impl_index(
        x, weight, bias, *stats, training, 0.1, 1e-5, torch.backends.cudnn.enabled)
    theirs = functools.partial(torch.ops.aten._batch_norm_impl_index_backward, impl, x, dy, weight, *stats,
                               save_mean, save_var, training, 1e-5, [True, True, True], reserve)
    return ours, theirs


def run(quick: bool = False, case_filter: str = "") -> list[harness.Row]:
    harness.require_gpu()
    rows = []
    for case, shape in [(c, s) for c, s in (SUITE[:1] if quick else SUITE) if case_filter in c]:
        B, C, H, W = shape
        fused = fits_one_tile(B, H * W, machine_of(torch.device("cuda")))
        for dtype in DTYPES:
            x = torch.randn(shape, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            weight, bias = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
            running_mean = torch.randn(C, device="cuda")
            running_var = torch.rand(C, device="cuda") + 0.5
            for mode in ("train", "eval"):
                training = mode == "train"
                for direction in ("forward", "backward"):
                    if direction == "forward":
                        ours = functools.partial(bn.batch_norm, x, running_mean, running_var, weight, bias, training)
                        theirs = functools.partial(F.batch_norm, x, running_mean, running_var, weight, bias, training)
                    else:
                        ours, theirs = _backward_calls(x, dy, weight, bias, running_mean, running_var, training)
                    ours_ms, torch_ms = harness.time_ms(ours), harness.time_ms(theirs)
                    passes = _passes(mode, direction, fused)
                    nbytes = passes * x.numel() * x.element_size()
                    extra = {}
                    if mode == "eval":
                        extra["seed_ms"] = f"{_seed_ms(direction, x, dy, weight, bias, running_mean, running_var):.4f}"
                    extra.update(bytes=f"{passes}Ne", **harness.bandwidth_columns(nbytes, ours_ms))
                    rows.append(harness.Row("batch_norm", f"{mode} {case}", str(dtype).replace("torch.", ""),
                                            direction, ours_ms, torch_ms, nbytes, "TB/s", extra))
            del x, dy
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", default="", help="only the suite's shapes whose name contains this (e.g. 7x7)")
    args = parser.parse_args()
    rows = run(quick=args.quick, case_filter=args.case)
    print(harness.report(rows, args.out, "batch_norm", f"batch_norm: nnkernels vs PyTorch; {BYTES_FORMULA}"))


if __name__ == "__main__":
    main()
