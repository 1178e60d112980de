"""`precompile_convs(shapes, dtype, jobs)`: compile, in `jobs` worker processes at once, every kernel that the first
calls of these convolutions may launch or time, so that the process which then runs them finds them in Triton's
disk cache instead of compiling them one after another.

Each worker runs `nnkernels.functional.conv.precompile` on fresh random tensors of one shape (tuning off there:
the candidates quick tuning would time, each launched once, nothing remembered). Workers are spawned, not
forked (CUDA cannot be forked), and share the parent's environment, so its Triton cache and interpreter mode.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

import torch

from .conv_calls import ConvShape


def _compile_conv(shape: ConvShape, dtype_name: str, tf32: bool, device: str):
    """In a worker: launch once, on scratch outputs, every choice quick tuning could time for `shape`."""
    os.environ["NNKERNELS_TUNE"] = "off"
    from .functional.conv import precompile

    torch.backends.cudnn.allow_tf32 = tf32
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape.x_shape, device=device).to(dtype)
    weight = torch.randn(shape.w_shape, device=device).to(dtype)
    precompile(x, weight, shape.stride, shape.padding, shape.dilation, shape.groups, shape.bias)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def precompile_convs(shapes, dtype: torch.dtype, jobs: int, device: str = "cuda") -> int:
    """Compile the kernels of each of `shapes` (ConvShapes) in `dtype` in `jobs` spawned processes, under the current
    TF32 setting; returns how many shapes were done. A worker's error is raised here."""
    shapes = list(dict.fromkeys(shapes))
    if not shapes:
        return 0
    dtype_name, tf32 = str(dtype).replace("torch.", ""), torch.backends.cudnn.allow_tf32
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(shapes)), mp_context=context) as pool:
        futures = [pool.submit(_compile_conv, shape, dtype_name, tf32, device) for shape in shapes]
        for future in futures:
            future.result()
    return len(shapes)
