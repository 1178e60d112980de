"""`channels_last(t)`: the NHWC copy of an NCHW tensor that the channels-last convolution kernels read
(`channels_last_pair(x, weight)`: both of a convolution's, in one launch);
`channels_first(t)`: the NCHW copy of an NHWC tensor that a channels-last kernel wrote;
`subsample(t, stride)`: t[:, :, ::s_h, ::s_w], contiguous, and `subsample_backward`, its adjoint.

`t.permute(0, 2, 3, 1).contiguous()`, bit for bit, by the tile-transpose kernel `ChannelsLastCopy`
(measured on the H200: 36 us for PyTorch's copy of a B32 C64 56x56 bf16 tensor, 11 us for the
tile transpose). Each launch is logged at DEBUG level on the "nnkernels" logger, like the ops'.
"""
import functools
import logging

import torch

from ..kernel import DTYPE_NAMES
from ..ops.common.layout import channels_last_kernel, channels_last_pair_kernel, channels_last_tiles
from ..ops.conv2d.subsample import Subsample2dBackward, Subsample2dForward, subsample_tiles

_log = logging.getLogger("nnkernels")


def _check(t, name="t"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: expected dtype torch.float32, torch.float16 or torch.bfloat16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _transpose(t, shape, rows, cols):
    """t as [N, rows, cols] copied into [N, cols, rows], returned with `shape`."""
    y = torch.empty(shape, dtype=t.dtype, device=t.device)
    if y.numel():
        _launch(channels_last_kernel(*channels_last_tiles(rows, cols), t.dtype), t, y, t.shape[0], rows, cols)
    return y


def channels_last(t):
    """`t.permute(0, 2, 3, 1).contiguous()` for a contiguous [N, C, H, W] tensor, by `ChannelsLastCopy`."""
    _check(t)
    n, c, h, w = t.shape
    return _transpose(t, (n, h, w, c), c, h * w)


def channels_last_pair(x, weight):
    """(channels_last(x), channels_last(weight)) for a convolution's input and weight of one dtype, in one
    launch of `ChannelsLastCopyPair` (two launches where either is empty)."""
    _check(x, "x")
    _check(weight, "weight")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: expected dtype {x.dtype} like x, got {weight.dtype}")
    n, c, h, w = x.shape
    c_out, c_in, kh, kw = weight.shape
    if not (x.numel() and weight.numel()):
        return channels_last(x), channels_last(weight)
    x_cl = torch.empty((n, h, w, c), dtype=x.dtype, device=x.device)
    weight_cl = torch.empty((c_out, kh, kw, c_in), dtype=x.dtype, device=x.device)
    kernel = channels_last_pair_kernel(channels_last_tiles(c, h * w), channels_last_tiles(c_in, kh * kw), x.dtype)
    _launch(kernel, x, x_cl, n, c, h * w, weight, weight_cl, c_out, c_in, kh * kw)
    return x_cl, weight_cl


def channels_first(t):
    """`t.permute(0, 3, 1, 2).contiguous()` for a contiguous [N, H, W, C] tensor: the same tile
    transpose, with the pixels as its rows and the channels as its columns."""
    _check(t)
    n, h, w, c = t.shape
    return _transpose(t, (n, c, h, w), h * w, c)


@functools.lru_cache(maxsize=None)
def _subsample_kernel(cls, stride, plane, dtype):
    return cls(*stride, *subsample_tiles(plane), dtype=dtype)


def _launch(kernel, *args):
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("layout launches %s", kernel.id)
    kernel.launch(*args)


def subsample(t, stride):
    """`t[:, :, ::stride[0], ::stride[1]].contiguous()` for a contiguous [N, C, H, W] tensor, by
    `Subsample2dForward`."""
    _check(t)
    n, c, h, w = t.shape
    oh, ow = -(-h // stride[0]), -(-w // stride[1])
    y = torch.empty((n, c, oh, ow), dtype=t.dtype, device=t.device)
    if y.numel():
        _launch(_subsample_kernel(Subsample2dForward, tuple(stride), oh * ow, t.dtype), t, y, n * c, h, w, oh, ow)
    return y


def subsample_backward(grad, shape, stride):
    """The gradient of `subsample` for an input of `shape`: `grad` at every stride-th pixel, zeros
    elsewhere, by `Subsample2dBackward`, which writes every element once."""
    _check(grad, "grad")
    n, c, h, w = shape
    x = torch.empty(shape, dtype=grad.dtype, device=grad.device)
    if x.numel():
        _launch(_subsample_kernel(Subsample2dBackward, tuple(stride), h * w, grad.dtype), grad, x, n * c, h, w,
                *grad.shape[2:])
    return x
