"""The 3x3 weight-gradient kernels swept over tiles and splits: `Conv2dTmaDw` and `Conv2dGemmClDw`,
each tile set at 1 to 6 programs per SM, the kernel and its reduce timed apart (`do_bench`), on
ResNet-50's stride-1 3x3 layers (B32). The tables in BENCHMARKS.md's sixth-session section come
from a scratch form of this script.

    PYTHONPATH=. python3 tools/conv_dw_sweep.py [--dtype bfloat16] [--layers "64@56,256@14"]

A tile set is (kernel, BLOCK_M, BLOCK_N, warps, stages, taps per program). Needs a GPU.
"""
import argparse

import torch
from triton.testing import do_bench

from nnkernels import tuning
from nnkernels.functional.conv2d_plan import Problem
from nnkernels.functional.layout import channels_last
from nnkernels.ops.conv2d.partials import dw_partial_size

LAYERS = {"64@56": (32, 64, 56), "128@28": (32, 128, 28), "256@14": (32, 256, 14), "512@7": (32, 512, 7)}
TILE_SETS = [("tma", 128, 64, 8, 3, 1), ("tma", 64, 64, 4, 3, 3), ("tma", 128, 128, 8, 3, 1), ("tma", 64, 64, 8, 3, 1),
             ("cl", 128, 64, 8, 3, 1), ("cl", 64, 64, 4, 3, 1)]
PROGRAMS_PER_SM = (1, 2, 3, 4, 6)


def sweep_configs(channels: int, dtype: torch.dtype, sms: int):
    """(kind, Config) for every tile set and programs-per-SM target, tiles clamped to the channels."""
    block_k = 64 if dtype != torch.float32 else 32
    for kind, block_m, block_n, warps, stages, taps in TILE_SETS:
        block_m, block_n = min(block_m, channels), min(block_n, channels)
        tiles = -(-channels // block_m) * -(-channels // block_n) * (9 // taps)
        for per_sm in PROGRAMS_PER_SM:
            yield kind, tuning.Config(block_m, block_n, block_k, warps, stages, max(1, per_sm * sms // tiles), taps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.layers.split(","):
        batch, channels, size = LAYERS[name]
        x = torch.randn(batch, channels, size, size, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        weight = torch.empty(channels, channels, 3, 3, device="cuda", dtype=dtype)
        problem = Problem(x.shape, weight.shape, (1, 1), (1, 1), (1, 1), 1, dtype, False)
        x_cl, dy_cl = channels_last(x), channels_last(dy)
        row = dw_partial_size(channels, channels, 3, 3, False)
        print(f"== {args.dtype} B{batch} C{channels} {size}x{size}: kernel + reduce µs", flush=True)
        for kind, config in sweep_configs(channels, dtype, sms):
            tma = kind == "tma"
            kernel = problem.tma_dw_kernel(config, False) if tma else problem.cl_dw_kernel(config, False)
            reduce = problem.reduce_kernel(False, problem.dw_taps(tma))
            partial = torch.empty(config.split, row, device="cuda")
            kernel_ms = do_bench(lambda: kernel.launch(dy_cl, x_cl, partial, *problem.sizes, config.split))
            reduce_ms = do_bench(lambda: reduce.launch(partial, weight, weight, config.split, weight.numel(), channels))
            tile = f"{config.block_m:3d} x {config.block_n:3d}, {config.num_warps} warps, {config.taps} taps"
            print(f"  {kind:3s} {tile}, split {config.split:4d}: {kernel_ms * 1e3:7.1f} + {reduce_ms * 1e3:5.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
