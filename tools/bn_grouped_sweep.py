"""Every grouped batch-norm config (channels per program x warps) on one shape, timed cold as the
bench times it (CUDA graph, do_bench, L2 flushed) and warm as the tuner times it (back to back).

    PYTHONPATH=. python3 tools/bn_grouped_sweep.py [--step eval_backward] [--dtype float32] [--shape 32,2048,7,7]

Shows whether a shape's time is a tuning choice: on the H200 every config of the fp32 eval
backward of B32 C2048 7x7 took 20.5 µs or more cold (12.8 µs warm). Needs a GPU.
"""
import argparse
import importlib

import torch

from nnkernels import tuning
from nnkernels.bench import harness
from nnkernels.ops.batch_norm.train import batch_norm_plan, grouped_plan

bn = importlib.import_module("nnkernels.functional.batch_norm")  # the package re-exports the function
STEPS = ("eval_backward", "train_backward", "eval_forward", "train_forward")


def configs(B, C, HW, element_size):
    """The tuner's candidates, then every (channels, warps) with at least 64 elements per warp."""
    found = bn.grouped_candidates(B, C, HW, element_size, batch_norm_plan(B, C, HW, element_size=element_size).channels)
    for channels in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4, 8):
            plan = grouped_plan(B, C, HW, channels, element_size)
            if plan.block_b * plan.block_j // warps >= 64:
                found.append(tuning.Config(plan.block_b, plan.block_j, channels, warps))
    return list(dict.fromkeys(found))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=STEPS, default="eval_backward")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--shape", default="32,2048,7,7", help="B,C,H,W (channels must fit one tile)")
    args = parser.parse_args()
    harness.require_gpu()
    B, C, H, W = (int(v) for v in args.shape.split(","))
    if not batch_norm_plan(B, C, H * W).fused:
        raise SystemExit(f"--shape: a channel of {args.shape} does not fit one tile; no grouped kernel runs")
    x = torch.randn(B, C, H, W, device="cuda", dtype=getattr(torch, args.dtype))
    dy = torch.randn_like(x)
    weight, bias = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
    running_mean, running_var = torch.randn(C, device="cuda"), torch.rand(C, device="cuda") + 0.5
    _, mean, rstd, _ = bn.batch_norm_train_op(x, weight, bias, 1e-5)
    step = {
        "eval_backward": lambda: bn.batch_norm_eval_backward_op(dy, x, running_mean, running_var, weight, 1e-5),
        "train_backward": lambda: bn.batch_norm_train_backward_op(dy, x, weight, mean, rstd),
        "eval_forward": lambda: bn.batch_norm_eval_op(x, running_mean, running_var, weight, bias, 1e-5),
        "train_forward": lambda: bn.batch_norm_train_op(x, weight, bias, 1e-5),
    }[args.step]
    original = tuning.choose
    rows = []
    try:
        for config in configs(B, C, H * W, x.element_size()):
            tuning.choose = lambda kind, key, candidates, run, chosen=config: chosen
            rows.append((harness.time_ms(step), tuning._time_ms(lambda _: step(), config), config))
    finally:
        tuning.choose = original
    print(f"{args.step} {args.dtype} {args.shape}: channels per program, warps, cold µs, warm µs")
    for cold, warm, config in sorted(rows, key=lambda row: row[0]):
        print(f"  {config.block_k:3} {config.num_warps:2}  {1000 * cold:7.1f}  {1000 * warm:7.1f}")


if __name__ == "__main__":
    main()
