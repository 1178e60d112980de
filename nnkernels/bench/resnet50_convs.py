"""Benchmark: every distinct convolution of torchvision's ResNet-50 at batch 64, 224 px, bf16, NCHW.

The 23 shapes of ResNet-50 (53 layers) that the `models` benchmark trains, each timed as in the conv2d suite
(forward; backward = dx + dw), with how many layers share it; the last line sums the layers'
times, forward + backward, weighted by that count, for both sides: the convolutions' share of
a training step. The stem's row includes its dx, which the step does not compute.

    python3 -m nnkernels.bench.resnet50_convs --out DIR   (or: nnkernels bench resnet50_convs)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import conv2d, harness
from .conv2d import Layer

BATCH = 64


def _layer(stage, c_in, c_out, size, kernel, stride, count):
    name = f"{stage} {kernel}x{kernel} {c_in}->{c_out} {size}" + (f" s{stride}" if stride > 1 else "") + f" x{count}"
    return Layer(name, BATCH, c_in, c_out, size, kernel, stride, kernel // 2, count=count)


# (stage, c_in, c_out, input size, kernel, stride, layers of this shape) of torchvision's resnet50 (v1.5:
# the stride sits on the 3x3); the 1x1 64->256 count includes layer1's downsample.
RESNET50 = [_layer(*spec) for spec in (
    ("stem", 3, 64, 224, 7, 2, 1),
    ("l1", 64, 64, 56, 1, 1, 1), ("l1", 256, 64, 56, 1, 1, 2), ("l1", 64, 64, 56, 3, 1, 3),
    ("l1", 64, 256, 56, 1, 1, 4),
    ("l2", 256, 128, 56, 1, 1, 1), ("l2", 128, 128, 56, 3, 2, 1), ("l2", 512, 128, 28, 1, 1, 3),
    ("l2", 128, 128, 28, 3, 1, 3), ("l2", 128, 512, 28, 1, 1, 4), ("l2", 256, 512, 56, 1, 2, 1),
    ("l3", 512, 256, 28, 1, 1, 1), ("l3", 256, 256, 28, 3, 2, 1), ("l3", 1024, 256, 14, 1, 1, 5),
    ("l3", 256, 256, 14, 3, 1, 5), ("l3", 256, 1024, 14, 1, 1, 6), ("l3", 512, 1024, 28, 1, 2, 1),
    ("l4", 1024, 512, 14, 1, 1, 1), ("l4", 512, 512, 14, 3, 2, 1), ("l4", 2048, 512, 7, 1, 1, 2),
    ("l4", 512, 512, 7, 3, 1, 2), ("l4", 512, 2048, 7, 1, 1, 3), ("l4", 1024, 2048, 14, 1, 2, 1),
)]


def run(quick: bool = False) -> list[harness.Row]:
    return conv2d.run(quick, precisions=["bf16"], seed=False, suite=RESNET50)


def weighted_totals(rows) -> str:
    """The layers' summed time per pass, each row weighted by its layer count, for both sides."""
    counts = {layer.name: layer.count for layer in RESNET50}
    lines = []
    for direction in ("forward", "backward"):
        chosen = [r for r in rows if r.direction == direction]
        ours = sum(counts[r.case] * r.ours_ms for r in chosen)
        theirs = sum(counts[r.case] * r.torch_ms for r in chosen)
        lines.append(f"resnet50 convolutions, {direction}, {sum(counts[r.case] for r in chosen)} layers: "
                     f"ours {ours:.3f} ms, torch {theirs:.3f} ms, speed-up {theirs / ours:.2f}x")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m nnkernels.bench.resnet50_convs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help="quick tuning")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    print(harness.report(rows, args.out, "resnet50_convs", "ResNet-50 convolutions, B64 bf16 NCHW: nnkernels vs cuDNN"))
    print(weighted_totals(rows))


if __name__ == "__main__":
    main()
