"""nnkernels: GPU kernels for training convolutional networks, written in Triton."""
from . import _mode  # noqa: F401  (first: it settles interpreted vs compiled before triton is imported)
from .functional import avg_pool2d, batch_norm, conv2d
from .kernel import CompiledKernel, KernelObject, catalogue, kernel_object
from .ops.avg_pool2d import Avgpool2dBackward, Avgpool2dForward
from .ops.batch_norm2d import BatchNorm2dNchwBackward, BatchNorm2dNchwForwardInference
from .ops.conv2d import Conv2dBackward, Conv2dForward

__all__ = [
    "Avgpool2dBackward",
    "avg_pool2d",
    "batch_norm",
    "conv2d",
    "Avgpool2dForward",
    "BatchNorm2dNchwBackward",
    "BatchNorm2dNchwForwardInference",
    "CompiledKernel",
    "Conv2dBackward",
    "Conv2dForward",
    "KernelObject",
    "catalogue",
    "kernel_object",
]
