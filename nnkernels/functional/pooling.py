"""`avg_pool2d`: `torch.nn.functional.avg_pool2d` on nnkernels' lanes, gather and channels-last kernels, with
autograd and torch.compile.

A call's signature (x's shape, strides, dtype and device, and the window options) finds its `AvgPool2dPlan`,
built (arguments checked) on the signature's first call; its forward and its backward each choose their kernel
and config on their first call (`pooling_algorithms`, tuned on the GPU) and bind it. Eagerly, autograd goes
through a `torch.autograd.Function`; under `torch.compile` the plans run inside the custom operators
`nnkernels::avg_pool2d` and `nnkernels::avg_pool2d_backward` (fake implementations), so graphs trace with no
break. `last_kernels("avg_pool2d")` names the kernels the latest calls launched.
"""
from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from .. import tuning
from .. import machine
from ..layer_shapes import AvgPoolShape
from ..ops.avg_pool2d.gather import pooled_size
from .common import (FLOAT_DTYPES, ArgumentError, PlanCache, aligned, building, direct_apply, elsewhere, operator,
                     record, register_autograd, register_fake, register_kernels)
from .double_backward import avg_pool2d_dx
from .layout import as_channels_last, nchw
from .pooling_algorithms import ChannelsLastPoolingPass, PoolingPass

_PLANS = PlanCache()


def _pair(value, name, *, lowest):
    """An int or a pair of ints, each >= lowest, as a 2-tuple."""
    if type(value) is int and value >= lowest:  # the common cases first: this runs on every call
        return (value, value)
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int and min(
            value) >= lowest:
        return value
    pair = (value, value) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(not isinstance(v, int) or isinstance(v, bool) for v in pair):
        raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")
    if min(pair) < lowest:
        raise ArgumentError(f"{name}: expected values >= {lowest}, got {value!r}")
    return pair


def window_options(kernel_size, stride, padding):
    """(kernel, stride, padding) as pairs of ints, the stride the kernel's where None or empty, as torch reads
    avg_pool2d's arguments; a bad value raises, naming the argument."""
    kernel = _pair(kernel_size, "kernel_size", lowest=1)
    strides = kernel if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _pair(
        stride, "stride", lowest=1)
    return kernel, strides, _pair(padding, "padding", lowest=0)


def _check(x, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override):
    """Validate every argument (nothing is launched before this passes)."""
    for name, flag in (("ceil_mode", ceil_mode), ("count_include_pad", count_include_pad)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ArgumentError(f"x: expected a 3-D (C, H, W) or 4-D (B, C, H, W) tensor, got shape {tuple(x.shape)}")
    if any(2 * p > k for p, k in zip(pads, kernel)):
        raise ArgumentError(f"padding: expected at most half of kernel_size {tuple(kernel)}, got {tuple(pads)}")
    if divisor_override is not None and (
            not isinstance(divisor_override, int) or isinstance(divisor_override, bool) or divisor_override < 1):
        raise ArgumentError(f"divisor_override: expected None or a positive int, got {divisor_override!r}")
    H, W = x.shape[-2:]
    if H + 2 * pads[0] < kernel[0] or W + 2 * pads[1] < kernel[1]:
        raise ArgumentError(f"x: padded input {H + 2 * pads[0]}x{W + 2 * pads[1]} is smaller than kernel_size "
                         f"{tuple(kernel)}")


def _output_size(H, W, kernel, stride, padding, ceil_mode):
    return (pooled_size(H, kernel[0], stride[0], padding[0], ceil_mode),
            pooled_size(W, kernel[1], stride[1], padding[1], ceil_mode))


class AvgPool2dPlan:
    """What every call with one signature runs: `run("forward", x)` and `run("backward", dy)` on 4-D tensors
    `ready` made: contiguous, or channels-last in a `channels_last` plan (x's strides are, as torch's
    `suggest_memory_format` judges them), whose kernels read and write that layout."""

    def __init__(self, shape, dtype, device, kernel, stride, padding, ceil_mode, count_include_pad, divisor,
                 channels_last=False):
        B, C, H, W = shape
        OH, OW = _output_size(H, W, kernel, stride, padding, ceil_mode)
        self.x_shape, self.y_shape, self.device = tuple(shape), (B, C, OH, OW), device
        self.window = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        self.channels_last = channels_last
        self.layer_call = AvgPoolShape(self.x_shape, tuple(kernel), tuple(stride), tuple(padding), ceil_mode,
                                       count_include_pad, divisor or 0, channels_last)  # its compile-ahead job
        self.runs_kernels = B * C * OH * OW > 0 and device.type != "meta"
        on = machine.machine_of(device)
        window = (kernel, stride, padding, count_include_pad, divisor)
        if channels_last:
            self.passes = {direction: ChannelsLastPoolingPass(direction, dtype, B, C, H, W, OH, OW, *window, on, device)
                           for direction in ("forward", "backward")}
        else:
            self.passes = {direction: PoolingPass(direction, dtype, B * C, H, W, OH, OW, *window, on, device)
                           for direction in ("forward", "backward")}
        self.out_shapes = {"forward": self.y_shape, "backward": self.x_shape}
        self.runners, self.ids = {}, {}

    def ready(self, t):
        """x or dy as the plan's kernels read it: channels-last or contiguous, aligned (a copy where not)."""
        return aligned(as_channels_last(t) if self.channels_last else nchw(t))

    def run(self, direction, source):
        if not self.runs_kernels:
            empty = source.new_empty(self.out_shapes[direction])
            return empty.contiguous(memory_format=torch.channels_last) if self.channels_last else empty
        switch = elsewhere(self.device)
        if switch is not None:
            with switch:
                return self.run(direction, source)
        runner = self.runners.get(direction)
        if runner is None:
            return self._first(direction, source)
        record("avg_pool2d", direction, self.ids[direction])
        return runner(source)

    def _first(self, direction, source):
        with building("avg_pool2d", direction, self.x_shape, [(self.layer_call, direction)]):
            if direction not in self.runners:
                pass_, out_shape, runners = self.passes[direction], self.out_shapes[direction], {}

                def runner_of(config):
                    if config not in runners:
                        runners[config] = pass_.runner(config, out_shape)
                    return runners[config]

                config = tuning.choose(pass_.kind, pass_.key, pass_.candidates, lambda c: runner_of(c)(source),
                                       pass_.decode)
                self.runners[direction], self.ids[direction] = runner_of(config), [pass_.kernel(config).id]
            return self.run(direction, source)  # its first launches compile what no candidate timed


def _suggests_channels_last(x):
    return x.dim() == 4 and suggest_memory_format(x) == torch.channels_last


def _plan(shape, strides, dtype, device, kernel, stride, padding, ceil_mode, count_include_pad, divisor, x=None):
    """The plan of a 4-D input of `shape`, `strides`, `dtype` on `device`; `x`, where given, is checked on the
    signature's first call (the backward operator's comes from a checked forward)."""
    signature = (shape, strides, dtype, device, kernel, stride, padding, ceil_mode, count_include_pad, divisor)
    plan = _PLANS.get(signature)
    if plan is None:
        def build():
            if x is not None:
                _check(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor or None)
            return AvgPool2dPlan(tuple(shape), dtype, device, kernel, stride, padding, ceil_mode, count_include_pad,
                                 divisor, x is not None and _suggests_channels_last(x))

        plan = _PLANS.build(signature, build)
    return plan


class _AvgPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return plan.run("forward", plan.ready(x))

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        if torch.is_grad_enabled():  # create_graph=True: dx as a differentiable map of dy
            return avg_pool2d_dx(dy, lambda g: plan.run("backward", plan.ready(g)), plan.window), None
        return plan.run("backward", plan.ready(dy)), None


_avg_pool2d = direct_apply(_AvgPool2d)


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """`torch.nn.functional.avg_pool2d` with the same arguments and results, on nnkernels' kernels.

    x: (B, C, H, W) or (C, H, W), float32/float16/bfloat16. Sums in fp32. Differences from torch:
    divisor_override must be positive (torch only refuses 0). Bad arguments raise a ValueError or TypeError
    naming the argument before anything is launched."""
    kernel, strides, pads = window_options(kernel_size, stride, padding)
    if not isinstance(x, torch.Tensor) or type(ceil_mode) is not bool or type(count_include_pad) is not bool:
        _check(x, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override)
    if divisor_override is not None and (type(divisor_override) is not int or divisor_override < 1):
        _check(x, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override)
    unbatched = x.dim() == 3
    batched = x.unsqueeze(0) if unbatched else x
    if torch.compiler.is_compiling():
        _check(batched, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override)
        y = avg_pool2d_op(batched, list(kernel), list(strides), list(pads), ceil_mode, count_include_pad,
                          divisor_override or 0)
    else:
        plan = _plan(batched.shape, batched.stride(), batched.dtype, batched.device, kernel, strides, pads, ceil_mode,
                     count_include_pad, divisor_override or 0, batched)
        if torch.is_grad_enabled() and batched.requires_grad:
            y = _avg_pool2d(batched, plan)
        else:
            y = plan.run("forward", plan.ready(batched))
    return y.squeeze(0) if unbatched else y


@operator("avg_pool2d")
def avg_pool2d_op(x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], ceil_mode: bool,
                  count_include_pad: bool, divisor_override: int) -> torch.Tensor:
    """4-D average pooling forward (divisor_override 0 = none); see `avg_pool2d`."""
    plan = _plan(x.shape, x.stride(), x.dtype, x.device, tuple(kernel_size), tuple(stride), tuple(padding), ceil_mode,
                 count_include_pad, divisor_override, x)
    return plan.run("forward", plan.ready(x))


@register_fake("avg_pool2d")
def _(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    B, C, H, W = x.shape
    y = x.new_empty(B, C, *_output_size(H, W, kernel_size, stride, padding, ceil_mode))
    return y.contiguous(memory_format=torch.channels_last) if _suggests_channels_last(x) else y


@operator("avg_pool2d_backward", derivative=False)
def avg_pool2d_backward_op(dy: torch.Tensor, input_height: int, input_width: int, kernel_size: list[int],
                           stride: list[int], padding: list[int], ceil_mode: bool, count_include_pad: bool,
                           divisor_override: int) -> torch.Tensor:
    """dx of `avg_pool2d_op` for an input of input_height x input_width, gathered (no atomics)."""
    B, C = dy.shape[:2]
    shape = torch.Size((B, C, input_height, input_width))
    strides = (C * input_height * input_width, input_height * input_width, input_width, 1)
    plan = _plan(shape, strides, dy.dtype, dy.device, tuple(kernel_size), tuple(stride), tuple(padding), ceil_mode,
                 count_include_pad, divisor_override)
    return plan.run("backward", plan.ready(dy))


@register_fake("avg_pool2d_backward")
def _(dy, input_height, input_width, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return dy.new_empty(dy.shape[0], dy.shape[1], input_height, input_width)


def _setup_context(ctx, inputs, output):
    x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override = inputs
    ctx.input_size = (x.shape[2], x.shape[3])
    ctx.options = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _backward(ctx, dy):
    dx = avg_pool2d_backward_op(dy, *ctx.input_size, *ctx.options)
    return dx, None, None, None, None, None, None


register_autograd("avg_pool2d", _backward, _setup_context)


def _kernel_classes():
    from ..kernel import catalogue

    return tuple(cls for cls in catalogue() if cls.__module__.startswith("nnkernels.ops.avg_pool2d.") and not cls.seed)


register_kernels("avg_pool2d", _kernel_classes())
