"""Batch norms of ResNet-50 (or MobileNetV3-Large) at batch 32, 224x224 input, on channels-last tensors, training
forward + backward: nnkernels' channels-last kernels against torch's own, `triton.testing.do_bench` (median ms) in
one process, bf16 and fp32; with --graph each side's step is captured in a CUDA graph and its replay timed.

    PYTHONPATH=. python tools/batch_norm_channels_last.py [--model mobilenet_v3_large] [--graph] [--bf16-only]
    (GPU; writes $OUT/bn_cl.json if OUT is set)
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nnkernels.functional import batch_norm

SHAPES = {
    "resnet50": ((32, 64, 112, 112), (32, 64, 56, 56), (32, 256, 56, 56), (32, 128, 28, 28), (32, 512, 28, 28),
                 (32, 256, 14, 14), (32, 1024, 14, 14), (32, 512, 7, 7), (32, 2048, 7, 7)),
    # channel counts that are multiples of 8 but not of 16, and one of 16s beside them
    "mobilenet_v3_large": ((32, 72, 56, 56), (32, 120, 28, 28), (32, 40, 28, 28), (32, 200, 14, 14),
                           (32, 64, 56, 56)),
}


def fwd_bwd_ms(fn, x, weight, bias, dy, graph):
    def step():
        y = fn(x, None, None, weight, bias, True, 0.1, 1e-5)
        torch.autograd.grad(y, (x, weight, bias), dy)

    if not graph:
        return do_bench(step)
    step()  # compiles and tunes outside the capture
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        step()
    return do_bench(captured.replay)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet50")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    parser.add_argument("--bf16-only", action="store_true")
    args = parser.parse_args()
    rows = []
    for dtype in (torch.bfloat16,) if args.bf16_only else (torch.bfloat16, torch.float32):
        for shape in SHAPES[args.model]:
            x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            dy = torch.randn_like(x)
            weight = torch.randn(shape[1], device="cuda", requires_grad=True)
            bias = torch.randn(shape[1], device="cuda", requires_grad=True)
            ours = fwd_bwd_ms(batch_norm, x, weight, bias, dy, args.graph)
            theirs = fwd_bwd_ms(F.batch_norm, x, weight, bias, dy, args.graph)
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), shape="x".join(map(str, shape)), ours_ms=ours,
                             torch_ms=theirs, x=theirs / ours))
            print(f"{rows[-1]['dtype']} {rows[-1]['shape']}: ours {ours:.3f} ms, torch {theirs:.3f} ms, "
                  f"{theirs / ours:.2f}x", flush=True)
    print(f"geometric mean {math.exp(sum(math.log(r['x']) for r in rows) / len(rows)):.2f}x")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bn_cl.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
