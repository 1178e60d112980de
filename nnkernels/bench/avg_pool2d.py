"""Benchmark: nnkernels' avg-pool vs PyTorch (and the seed kernels where they apply). The op runs
the lanes kernels where they apply and the gather kernels otherwise, each with the config tuning
picks per shape (the tuner logs every candidate's time at DEBUG level on the "nnkernels" logger).

Bytes the pass must move: forward reads x and writes y, backward reads dy and writes dx, so
both move (numel(x) + numel(y)) * element size. The floor is that over the 4.27 TB/s copy ceiling
(of_peak); of_copy is the time of a copy moving the same bytes, measured in the same run, over ours.
Run: python3 -m nnkernels.bench.avg_pool2d --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import harness
from ..functional import pooling as pool
from ..ops.avg_pool2d.seed import Avgpool2dBackward, Avgpool2dForward

BYTES_FORMULA = ("bytes = (numel(x) + numel(y)) * elem_size, both passes; floor = bytes / 4.27 TB/s; "
                 "of_copy = same-size copy time / ours")
# (case, input shape, kernel_size, stride, padding)
SUITE = (
    ("B32 C256 56x56 k2 s2", (32, 256, 56, 56), 2, 2, 0),
    ("B32 C256 56x56 k3 s1 p1", (32, 256, 56, 56), 3, 1, 1),
    ("B64 C512 28x28 k3 s2", (64, 512, 28, 28), 3, 2, 0),
)
DTYPES = (torch.float32, torch.bfloat16)


def _seed_ms(direction, x, y, k, s):
    """The seed kernel's time (no padding only); the backward includes the zero-init it needs."""
    B, C, H, W = x.shape
    OH, OW = y.shape[2:]
    if direction == "forward":
        seed = Avgpool2dForward(k, k, s, s, 64, dtype=x.dtype)
        return harness.time_ms(lambda: seed.launch(x, y, B, C, H, W, OH, OW))
    seed = Avgpool2dBackward(k, k, s, s, 64, dtype=x.dtype)
    dx = torch.empty_like(x)

    def zero_and_scatter():
        dx.zero_()
        seed.launch(y, dx, B, C, H, W, OH, OW)

    return harness.time_ms(zero_and_scatter)


def _row(case, dtype, direction, ours_ms, torch_ms, nbytes, extra):
    extra = dict(extra, **harness.bandwidth_columns(nbytes, ours_ms))
    return harness.Row("avg_pool2d", case, str(dtype).replace("torch.", ""), direction, ours_ms, torch_ms, nbytes,
                       "TB/s", extra)


def _case_rows(case, shape, k, s, p, dtype) -> list[harness.Row]:
    """The forward and backward rows of one case and dtype (its tensors freed on return)."""
    x = torch.randn(shape, device="cuda", dtype=dtype)
    y = pool.avg_pool2d(x, k, s, p)
    dy = torch.randn_like(y)
    H, W = shape[2:]
    nbytes = (x.numel() + y.numel()) * x.element_size()
    seed = {} if p else {"seed_ms": f"{_seed_ms('forward', x, y, k, s):.4f}"}
    forward = _row(case, dtype, "forward", harness.time_ms(lambda: pool.avg_pool2d(x, k, s, p)),
                   harness.time_ms(lambda: F.avg_pool2d(x, k, s, p)), nbytes, seed)
    ours_bwd = functools.partial(pool.avg_pool2d_backward_op, dy, H, W, [k, k], [s, s], [p, p], True, 0)
    torch_bwd = functools.partial(torch.ops.aten.avg_pool2d_backward, dy, x, [k, k], [s, s], [p, p], False,
                                  True, None)
    seed = {} if p else {"seed_ms": f"{_seed_ms('backward', x, dy, k, s):.4f}"}
    backward = _row(case, dtype, "backward", harness.time_ms(ours_bwd), harness.time_ms(torch_bwd), nbytes, seed)
    return [forward, backward]


def run(quick: bool = False) -> list[harness.Row]:
    harness.require_gpu()
    return [row for case, shape, k, s, p in (SUITE[:1] if quick else SUITE) for dtype in DTYPES
            for row in _case_rows(case, shape, k, s, p, dtype)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    print(harness.report(rows, args.out, "avg_pool2d", f"avg_pool2d: nnkernels vs PyTorch; {BYTES_FORMULA}"))


if __name__ == "__main__":
    main()
