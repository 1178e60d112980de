"""Torch-facing ops: checks, plans, autograd, registration with torch.library.

One module per op, each with `torch.nn.functional`'s semantics (`conv`, `conv_transpose`, `pooling`,
`batchnorm`); this package re-exports the functions.
"""
from .batchnorm import batch_norm
from .common import clear_plans, last_kernels
from .conv import conv2d
from .conv_transpose import conv_transpose2d
from .pooling import avg_pool2d

__all__ = ["avg_pool2d", "batch_norm", "clear_plans", "conv2d", "conv_transpose2d", "last_kernels"]
