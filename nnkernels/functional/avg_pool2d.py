"""`avg_pool2d`: `torch.nn.functional.avg_pool2d` on nnkernels' lanes and gather kernels, with autograd.

The lanes kernels' program size, warp count and group width are chosen per shape by
`nnkernels.tuning.choose` (timed once per shape and GPU, remembered on disk; the first guess in the
interpreter, with NNKERNELS_TUNE=off, or while a CUDA graph is being captured).

Registered as the custom operators `nnkernels::avg_pool2d` and `nnkernels::avg_pool2d_backward`
(each with a fake implementation), so `torch.compile(fullgraph=True)` traces through it.
`last_kernels()` names the kernel objects the latest call launched.
"""
from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from .. import _mode  # noqa: F401  (first: settles Triton's mode before the kernel modules import triton)
from .. import tuning

from ..ops.avg_pool2d.gather import (
    AvgPool2dGatherBackward,
    AvgPool2dGatherForward,
    contiguous_row_align,
    lanes_candidates,
    pooled_size,
    pooling_config,
    row_align,
    uniform_divisor,
)
from ..ops.avg_pool2d.lanes import (
    AvgPool2dLanesBackward,
    AvgPool2dLanesForward,
    backward_lane_widths,
    backward_lanes,
    backward_src_vec,
    forward_lane_widths,
    forward_lanes,
)

# The kernel classes this op launches (for `nnkernels list`).
KERNEL_CLASSES = (AvgPool2dLanesForward, AvgPool2dLanesBackward, AvgPool2dGatherForward, AvgPool2dGatherBackward)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

log = logging.getLogger("nnkernels")
_last_kernels: dict[str, str] = {}


def last_kernels() -> dict[str, str]:
    """{"forward": id, "backward": id}: the kernel objects the latest forward and backward launched."""
    return dict(_last_kernels)


def _pair(value, name, *, lowest):
    """An int or a pair of ints, each >= lowest, as a 2-list."""
    pair = [value, value] if isinstance(value, int) else list(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in pair):
        raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")
    if min(pair) < lowest:
        raise ValueError(f"{name}: expected values >= {lowest}, got {value!r}")
    return pair


def _check(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Validate every argument (nothing is launched before this passes); return the normalised options."""
    for name, flag in (("ceil_mode", ceil_mode), ("count_include_pad", count_include_pad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected a 3-D (C, H, W) or 4-D (B, C, H, W) tensor, got shape {tuple(x.shape)}")
    kernel = _pair(kernel_size, "kernel_size", lowest=1)
    strides = kernel if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _pair(
        stride, "stride", lowest=1)
    pads = _pair(padding, "padding", lowest=0)
    if any(2 * p > k for p, k in zip(pads, kernel)):
        raise ValueError(f"padding: expected at most half of kernel_size {tuple(kernel)}, got {tuple(pads)}")
    if divisor_override is not None and (
        not isinstance(divisor_override, int) or isinstance(divisor_override, bool) or divisor_override < 1
    ):
        raise ValueError(f"divisor_override: expected None or a positive int, got {divisor_override!r}")
    H, W = x.shape[-2:]
    if H + 2 * pads[0] < kernel[0] or W + 2 * pads[1] < kernel[1]:
        raise ValueError(
            f"x: padded input {H + 2 * pads[0]}x{W + 2 * pads[1]} is smaller than kernel_size {tuple(kernel)}"
        )
    return kernel, strides, pads


@functools.lru_cache(maxsize=None)
def _kernel(cls, dtype, *constants, num_warps):
    return cls(*constants, dtype=dtype, num_warps=num_warps)


def _choices(direction, dtype, planes, H, W, OH, OW, kernel, stride, padding, count_include_pad, divisor):
    """(kind, candidates, make) for one pass: `candidates()` lists the configs, `make(config)` is the kernel
    object of one.
    The lanes kernel (vector row loads) where its contract holds, with `lanes_candidates` to tune
    among; else the one gather kernel, which takes every case (a single candidate: never timed)."""
    # The window options under the attribute names `uniform_divisor` and the lane rules read.
    options = SimpleNamespace(kh=kernel[0], kw=kernel[1], stride_h=stride[0], stride_w=stride[1], pad_h=padding[0],
                              pad_w=padding[1], count_include_pad=count_include_pad, divisor_override=divisor)
    uniform = uniform_divisor(options, H, W, OH, OW)
    itemsize = dtype.itemsize
    common = (*kernel, *stride, *padding, count_include_pad, divisor, uniform)
    if direction == "backward":
        rows, cols = planes * H, W
        lanes = backward_lanes(options, W, OW, itemsize, uniform)[0]
        if lanes:
            def make(c):
                return _kernel(AvgPool2dLanesBackward, dtype, *common, c.block_k, backward_src_vec(options, OW, c.block_k),
                               min(row_align(cols), c.block_k), c.block_m, c.block_n, num_warps=c.num_warps)
            widths = backward_lane_widths(options, W, uniform)
            return "avg_pool2d_lanes_backward", lambda: lanes_candidates(rows, cols, widths, lanes, itemsize), make
        # Each dx gathers from the windows that may cover it: cdiv(k, stride) per axis.
        taps = -(-kernel[0] // stride[0]) * -(-kernel[1] // stride[1])
        block_r, block_w, num_warps = pooling_config(rows, cols, taps)
        gather = _kernel(AvgPool2dGatherBackward, dtype, *common, row_align(cols), block_r, block_w,
                         num_warps=num_warps)
        return "avg_pool2d_gather_backward", lambda: [None], lambda c: gather
    rows, cols = planes * OH, OW
    lanes = forward_lanes(options, W, itemsize)
    if lanes:
        def make(c):
            return _kernel(AvgPool2dLanesForward, dtype, *common, c.block_k, min(row_align(cols), c.block_k),
                           c.block_m, c.block_n, num_warps=c.num_warps)
        widths = forward_lane_widths(options, W)
        return "avg_pool2d_lanes_forward", lambda: lanes_candidates(rows, cols, widths, lanes, itemsize), make
    block_r, block_w, num_warps = pooling_config(rows, cols, kernel[0] * kernel[1])
    gather = _kernel(AvgPool2dGatherForward, dtype, *common, row_align(cols), contiguous_row_align(options, W, OW),
                     block_r, block_w, num_warps=num_warps)
    return "avg_pool2d_gather_forward", lambda: [None], lambda c: gather


def _launch(direction, source, out, H, W, OH, OW, kernel, stride, padding, count_include_pad, divisor):
    """Launch the forward (source = x, out = y) or the backward (source = dy, out = dx), with the
    config `tuning.choose` picks (timed once per shape on the GPU; every config writes all of `out`)."""
    planes = out.shape[0] * out.shape[1]
    shape = (planes, H, W, OH, OW, tuple(kernel), tuple(stride), tuple(padding), count_include_pad, divisor)
    kind, candidates, make = _choices(direction, out.dtype, *shape)
    key = (str(out.dtype).replace("torch.", ""), *shape)

    def run(config):
        k = make(config)
        k.launch(source, out, planes, H, W, OH, OW)
        return k

    k = run(tuning.choose(kind, key, candidates, run))
    _last_kernels[direction] = k.id
    log.debug("avg_pool2d %s: %s", direction, k.id)


def _output_size(H, W, kernel, stride, padding, ceil_mode):
    return (pooled_size(H, kernel[0], stride[0], padding[0], ceil_mode),
            pooled_size(W, kernel[1], stride[1], padding[1], ceil_mode))


@torch.library.custom_op("nnkernels::avg_pool2d", mutates_args=())
def avg_pool2d_op(
    x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], ceil_mode: bool,
    count_include_pad: bool, divisor_override: int,
) -> torch.Tensor:
    """4-D average pooling forward (divisor_override 0 = none); see `avg_pool2d`."""
    B, C, H, W = x.shape
    OH, OW = _output_size(H, W, kernel_size, stride, padding, ceil_mode)
    y = x.new_empty(B, C, OH, OW)
    if y.numel():
        _launch("forward", x.contiguous(), y, H, W, OH, OW, kernel_size, stride, padding,
                count_include_pad, divisor_override)
    return y


@avg_pool2d_op.register_fake
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    B, C, H, W = x.shape
    return x.new_empty(B, C, *_output_size(H, W, kernel_size, stride, padding, ceil_mode))


@torch.library.custom_op("nnkernels::avg_pool2d_backward", mutates_args=())
def avg_pool2d_backward_op(
    dy: torch.Tensor, input_height: int, input_width: int, kernel_size: list[int], stride: list[int],
    padding: list[int], count_include_pad: bool, divisor_override: int,
) -> torch.Tensor:
    """dx of `avg_pool2d_op` for an input of input_height x input_width, gathered (no atomics)."""
    B, C, OH, OW = dy.shape
    dx = dy.new_empty(B, C, input_height, input_width)
    if dx.numel():
        _launch("backward", dy.contiguous(), dx, input_height, input_width, OH, OW, kernel_size,
                stride, padding, count_include_pad, divisor_override)
    return dx


@avg_pool2d_backward_op.register_fake
def _(dy, input_height, input_width, kernel_size, stride, padding, count_include_pad, divisor_override):
    return dy.new_empty(dy.shape[0], dy.shape[1], input_height, input_width)


def _setup_context(ctx, inputs, output):
    x, kernel_size, stride, padding, _, count_include_pad, divisor_override = inputs
    ctx.input_size = (x.shape[2], x.shape[3])
    ctx.options = (kernel_size, stride, padding, count_include_pad, divisor_override)


def _backward(ctx, dy):
    dx = avg_pool2d_backward_op(dy, *ctx.input_size, *ctx.options)
    return dx, None, None, None, None, None, None


avg_pool2d_op.register_autograd(_backward, setup_context=_setup_context)


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """`torch.nn.functional.avg_pool2d` with the same arguments and results, on nnkernels' kernels.

    x: (B, C, H, W) or (C, H, W), float32/float16/bfloat16. Sums in fp32. Differences from PyTorch:
    divisor_override must be positive (PyTorch only refuses 0). Bad arguments raise a ValueError
    or TypeError naming the argument before anything is launched.
    """
    kernel, strides, pads = _check(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    batched = x if x.dim() == 4 else x.unsqueeze(0)
    y = avg_pool2d_op(batched, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override or 0)
    return y if x.dim() == 4 else y.squeeze(0)
