"""Torch-facing ops: checks, choice of kernel, autograd, registered with torch.library.

One module per op, each with `torch.nn.functional`'s semantics; this package re-exports them.
"""
from .avg_pool2d import avg_pool2d
from .batch_norm import batch_norm
from .conv2d import conv2d

__all__ = ["avg_pool2d", "batch_norm", "conv2d"]
