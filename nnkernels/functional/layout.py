"""Layout copies the convolution algorithms make, as factories a plan calls once per signature: each returns a
function that allocates the copy and launches its kernel (a `Launcher`) on every call.

- `channels_last_copy(shape, dtype, device)`: t -> t.permute(0, 2, 3, 1).contiguous() for [N, C, H, W]
  (`ChannelsLastCopy`, a tile transpose, bit for bit torch's copy);
- `channels_first_copy(shape, dtype, device)`: [N, H, W, C] -> [N, C, H, W], the same transpose the other way;
- `channels_last_pair_copy(x_shape, w_shape, dtype, device)`: two of those copies in one launch (a convolution's
  input and weight; a backward's dy and x);
- `subsample_copy(shape, stride, dtype, device)`: t[:, :, ::s_h, ::s_w].contiguous(), and
  `subsample_adjoint(...)`, its adjoint (zeros off the lattice).
Each factory's `*_kernels` twin names the kernels its copy launches (none for an empty tensor), for the lists of
what a call launches.
`channels_last(t)`, `channels_first(t)`, `channels_last_pair(x, w)`, `subsample(t, stride)` and
`subsample_backward(grad, shape, stride)` make the same copies once, with every argument checked.

`nchw(t)` and `as_channels_last(t)` are what the ops use to read a channels-last input and to give a
channels-last output: `t.contiguous()` and `t.contiguous(memory_format=torch.channels_last)`, through the tile
transpose where it applies (torch's permuted copy ran at about a third of its speed).
"""
from __future__ import annotations

import functools
import math

import torch

from ..kernel import DTYPE_NAMES
from ..launcher import Launcher
from .common import allocator, channels_last_allocator
from ..ops.common.layout import channels_last_kernel, channels_last_pair_kernel
from ..ops.conv2d.subsample import Subsample2dBackward, Subsample2dForward, subsample_tiles


def _identity(rows, cols) -> bool:
    """Whether transposing [rows, cols] leaves the memory as it is: a single row or column (a 1x1 weight)."""
    return rows == 1 or cols == 1


def _transpose_kernels(images, rows, cols, dtype):
    moves = images * rows * cols and not _identity(rows, cols)
    return [channels_last_kernel(rows, cols, dtype)] if moves else []


def transpose_copy(images, rows, cols, out_shape, dtype, device):
    """t, contiguous, of any shape holding [images, rows, cols] -> [images, cols, rows], returned with `out_shape`
    (no view of t is made: the kernel reads it by its sizes); where the transpose moves nothing, t itself viewed
    as `out_shape`."""
    new, kernels = allocator(dtype, device), _transpose_kernels(images, rows, cols, dtype)
    if not kernels:
        if images * rows * cols:
            return lambda t: t.view(out_shape)
        return lambda t: new(*out_shape)
    launch = Launcher(kernels[0])

    def copy(t):
        y = new(*out_shape)
        launch(t, y, images, rows, cols)
        return y

    return copy


def channels_last_copy_kernels(shape, dtype):
    n, c, h, w = shape
    return _transpose_kernels(n, c, h * w, dtype)


def channels_last_copy(shape, dtype, device):
    n, c, h, w = shape
    return transpose_copy(n, c, h * w, (n, h, w, c), dtype, device)


def channels_last_result(shape, dtype, device):
    """t, contiguous [N, C, H, W] -> the same values channels-last: an [N, C, H, W] tensor with channels-last
    strides (`channels_last_allocator`), which the transpose writes as the NHWC array it stores."""
    n, c, h, w = shape
    new, kernels = channels_last_allocator(dtype, device), _transpose_kernels(n, c, h * w, dtype)
    if not kernels:
        if n * c * h * w:
            return _same  # one channel or one pixel: t is channels-last as it is
        return lambda t: new(n, c, h, w)
    launch = Launcher(kernels[0])

    def copy(t):
        y = new(n, c, h, w)
        launch(t, y.permute(0, 2, 3, 1), n, c, h * w)
        return y

    return copy


def channels_first_copy_kernels(shape, dtype):
    n, h, w, c = shape
    return _transpose_kernels(n, h * w, c, dtype)


def channels_first_copy(shape, dtype, device):
    n, h, w, c = shape
    return transpose_copy(n, h * w, c, (n, c, h, w), dtype, device)


def _pair_in_one_launch(x_shape, w_shape):
    return math.prod(x_shape) and math.prod(w_shape)


def channels_last_pair_kernels(x_shape, w_shape, dtype):
    if not _pair_in_one_launch(x_shape, w_shape):
        return channels_last_copy_kernels(x_shape, dtype) + channels_last_copy_kernels(w_shape, dtype)
    (_, c, h, w), (_, c_in, kh, kw) = x_shape, w_shape
    return [channels_last_pair_kernel(c, h * w, c_in, kh * kw, dtype)]


def channels_last_pair_copy(x_shape, w_shape, dtype, device):
    """(x, weight) -> (channels-last x, channels-last weight), in one launch of `ChannelsLastCopyPair`; any two 4-D
    tensors, the second's last two dimensions taken as one."""
    n, c, h, w = x_shape
    c_out, c_in, kh, kw = w_shape
    if not _pair_in_one_launch(x_shape, w_shape):
        copy_x, copy_w = channels_last_copy(x_shape, dtype, device), channels_last_copy(w_shape, dtype, device)
        return lambda x, weight: (copy_x(x), copy_w(weight))
    launch = Launcher(channels_last_pair_kernels(x_shape, w_shape, dtype)[0])
    new, x_cl_shape, w_cl_shape = allocator(dtype, device), (n, h, w, c), (c_out, kh, kw, c_in)

    def copy(x, weight):
        x_cl, weight_cl = new(*x_cl_shape), new(*w_cl_shape)
        launch(x, x_cl, n, c, h * w, weight, weight_cl, c_out, c_in, kh * kw)
        return x_cl, weight_cl

    return copy


@functools.lru_cache(maxsize=None)
def _subsample_kernel(cls, stride, plane, dtype):
    return cls(*stride, *subsample_tiles(plane), dtype=dtype)


def _subsampled(shape, stride):
    n, c, h, w = shape
    return n, c, -(-h // stride[0]), -(-w // stride[1])


def subsample_kernels(shape, stride, dtype):
    _, _, oh, ow = _subsampled(shape, stride)
    return [_subsample_kernel(Subsample2dForward, tuple(stride), oh * ow, dtype)] if math.prod(shape) else []


def subsample_copy(shape, stride, dtype, device):
    n, c, h, w = shape
    out_shape, kernels = _subsampled(shape, stride), subsample_kernels(shape, stride, dtype)
    new = allocator(dtype, device)
    if not kernels:
        return lambda t: new(*out_shape)
    launch, (oh, ow) = Launcher(kernels[0]), out_shape[2:]

    def copy(t):
        y = new(*out_shape)
        launch(t, y, n * c, h, w, oh, ow)
        return y

    return copy


def subsample_adjoint_kernels(shape, stride, dtype):
    plane = shape[2] * shape[3]
    return [_subsample_kernel(Subsample2dBackward, tuple(stride), plane, dtype)] if math.prod(shape) else []


def subsample_adjoint(grad_shape, shape, stride, dtype, device):
    """grad [N, C, OH, OW] -> [N, C, H, W] with grad at every stride-th pixel and zeros elsewhere
    (`Subsample2dBackward` writes every element once)."""
    n, c, h, w = shape
    new, kernels = allocator(dtype, device), subsample_adjoint_kernels(shape, stride, dtype)
    if not kernels:
        return lambda grad: new(*shape)
    launch = Launcher(kernels[0])
    sizes = (n * c, h, w, *grad_shape[2:])

    def spread(grad):
        x = new(*shape)
        launch(grad, x, *sizes)
        return x

    return spread


def _same(t):
    return t


@functools.lru_cache(maxsize=256)
def _cached_copy(factory, shape, dtype, device):
    return factory(shape, dtype, device)


def _transposable(t) -> bool:
    # The cached launch was specialised on a 16-byte aligned address, as every plan's launches are.
    return t.dtype in DTYPE_NAMES and t.device.type != "meta" and t.data_ptr() % 16 == 0


def nchw(t: torch.Tensor) -> torch.Tensor:
    """`t.contiguous()`: `t` itself where it is contiguous; a 4-D channels-last `t` through `channels_first_copy`."""
    if t.is_contiguous():
        return t
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and _transposable(t):
        n, c, h, w = t.shape
        return _cached_copy(channels_first_copy, (n, h, w, c), t.dtype, t.device)(t.permute(0, 2, 3, 1))
    return t.contiguous()


def as_channels_last(t: torch.Tensor) -> torch.Tensor:
    """`t.contiguous(memory_format=torch.channels_last)` for a 4-D `t`: a contiguous `t` through
    `channels_last_result`."""
    if t.is_contiguous(memory_format=torch.channels_last):
        return t
    if t.is_contiguous() and _transposable(t):
        return _cached_copy(channels_last_result, tuple(t.shape), t.dtype, t.device)(t)
    return t.contiguous(memory_format=torch.channels_last)


def _check(t, name="t"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: expected dtype torch.float32, torch.float16 or torch.bfloat16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def channels_last(t):
    """`t.permute(0, 2, 3, 1).contiguous()` for a contiguous [N, C, H, W] tensor."""
    _check(t)
    return channels_last_copy(t.shape, t.dtype, t.device)(t)


def channels_first(t):
    """`t.permute(0, 3, 1, 2).contiguous()` for a contiguous [N, H, W, C] tensor."""
    _check(t)
    return channels_first_copy(t.shape, t.dtype, t.device)(t)


def channels_last_pair(x, weight):
    """(channels_last(x), channels_last(weight)) for a convolution's input and weight of one dtype."""
    _check(x, "x")
    _check(weight, "weight")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: expected dtype {x.dtype} like x, got {weight.dtype}")
    return channels_last_pair_copy(x.shape, weight.shape, x.dtype, x.device)(x, weight)


def subsample(t, stride):
    """`t[:, :, ::stride[0], ::stride[1]].contiguous()` for a contiguous [N, C, H, W] tensor."""
    _check(t)
    return subsample_copy(t.shape, stride, t.dtype, t.device)(t)


def subsample_backward(grad, shape, stride):
    """The gradient of `subsample` for an input of `shape`."""
    _check(grad, "grad")
    return subsample_adjoint(grad.shape, shape, stride, grad.dtype, grad.device)(grad)
