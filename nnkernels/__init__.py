"""nnkernels: GPU kernels for training convolutional networks, written in Triton.

Layers, top to bottom: `nnkernels.nn` (drop-in modules and `convert`), the functional ops
(`conv2d`, `avg_pool2d`, `batch_norm`), the kernel objects (`catalogue()`), Triton.
"""
from . import _mode  # noqa: F401  (first: it settles interpreted vs compiled before triton is imported)
from . import nn
from .functional import avg_pool2d, batch_norm, conv2d
from .kernel import CompiledKernel, KernelObject, catalogue, compile_all, kernel_object
from .nn import convert
from .ops.avg_pool2d.seed import Avgpool2dBackward, Avgpool2dForward
from .ops.batch_norm.seed import BatchNorm2dNchwBackward, BatchNorm2dNchwForwardInference
from .ops.conv2d.seed import Conv2dBackward, Conv2dForward

__all__ = [
    "Avgpool2dBackward",
    "Avgpool2dForward",
    "BatchNorm2dNchwBackward",
    "BatchNorm2dNchwForwardInference",
    "CompiledKernel",
    "Conv2dBackward",
    "Conv2dForward",
    "KernelObject",
    "avg_pool2d",
    "batch_norm",
    "catalogue",
    "compile_all",
    "conv2d",
    "convert",
    "kernel_object",
    "nn",
]
