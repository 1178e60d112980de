"""`conv_transpose2d`: torch.nn.functional.conv_transpose2d on nnkernels' kernels, with autograd, autocast and
torch.compile.

A transposed convolution is a convolution's input gradient. y = conv_transpose2d(x, w) is dx of the convolution
whose input has y's shape and whose weight is w as it is (a transposed weight [C_IN, C_OUT/G, KH, KW] is the
weight of a convolution with C_IN outputs), given x as that convolution's output gradient. So a call's plan is
that convolution's `Conv2dPlan`: the forward runs the plan's dx; the backward runs its forward for dx
(conv2d(dy, w)) and its dw with x as the output gradient and dy as the input. The bias is added to y, and its
gradient is dy's sum. The kernels, their tuning and the record of what launched are the convolution's
(`last_kernels("conv2d")`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .common import KERNELS, ArgumentError, PlanCache, operator, register_fake, register_kernels
from .conv import (INT32_LIMIT, Conv2dPlan, _autocast, _empty, _is_channels_last, _pair, channels_last_output,
                   check_tensors, conv2d, planned, register_conv_autocast, register_conv_autograd)
from .double_backward import conv2d_grads

_PLANS = PlanCache()


def transposed_size(size, kernel, stride, padding, output_padding, dilation):
    """An output side of a transposed convolution, as torch computes it."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def _check(x, weight, bias, stride, padding, output_padding, groups, dilation):
    """Raise ValueError/TypeError (NotImplementedError for what torch takes and nnkernels does not) naming the
    first bad argument."""
    check_tensors(x, weight, bias, "[C_IN, C_OUT/groups, KH, KW]")
    if type(groups) is not int or groups < 1:
        raise ArgumentError(f"groups: expected a positive int, got {groups!r}")
    c_in, per_group, kh, kw = weight.shape
    if x.shape[-3] != c_in:
        raise ArgumentError(f"input: expected {c_in} channels (the weight's dim 0), got {x.shape[-3]}")
    if c_in % groups:
        raise ArgumentError(f"groups: {groups} does not divide the input's {c_in} channels")
    c_out = per_group * groups
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ArgumentError(f"bias: expected shape ({c_out},), got {tuple(bias.shape)}")
    if min(x.shape[-3:]) < 1 or min(weight.shape) < 1:
        raise ArgumentError(f"input/weight: expected non-empty tensors (the batch may be 0), got {tuple(x.shape)} and "
                            f"{tuple(weight.shape)}")
    for name, values, low in (("stride", stride, 1), ("padding", padding, 0), ("output_padding", output_padding, 0),
                              ("dilation", dilation, 1)):
        if min(values) < low:
            raise ArgumentError(f"{name}: expected values >= {low}, got {tuple(values)}")
    for axis in (0, 1):
        if output_padding[axis] >= max(stride[axis], dilation[axis]):
            raise ArgumentError(f"output_padding: expected values smaller than either stride or dilation, got "
                                f"{tuple(output_padding)} with stride {tuple(stride)} and dilation {tuple(dilation)}")
        if output_padding[axis] >= stride[axis]:  # torch takes it below the dilation; the input gradient does not
            raise NotImplementedError(f"output_padding: nnkernels needs values below the stride {tuple(stride)}, got "
                                      f"{tuple(output_padding)}")
    out = [transposed_size(x.shape[-2 + axis], (kh, kw)[axis], stride[axis], padding[axis], output_padding[axis],
                           dilation[axis]) for axis in (0, 1)]
    if min(out) < 1:
        raise ArgumentError(f"input: output size {tuple(out)} is too small for input {tuple(x.shape[-2:])}, kernel "
                            f"{(kh, kw)}, stride {tuple(stride)}, padding {tuple(padding)}")
    if c_in * x.shape[-2] * x.shape[-1] >= INT32_LIMIT or c_out * out[0] * out[1] >= INT32_LIMIT or (
            weight.numel() >= INT32_LIMIT):
        raise ArgumentError("input: one image (C_IN*H*W), one output image (C_OUT*OH*OW) and the weight must each "
                            "hold fewer than 2**31 elements")


class ConvTranspose2dPlan:
    """What every call with one signature runs, on the convolution's plan `conv` whose dx it is: `forward(x,
    weight, bias)` and `backward(dy, x, weight, needs)`, on the 4-D tensors `prepare` made ready (as
    `Conv2dPlan`'s, whose autograd Function it shares)."""

    def __init__(self, conv: Conv2dPlan, has_bias: bool, unbatched: bool):
        self.conv, self.has_bias, self.unbatched = conv, has_bias, unbatched
        self.args = conv.args  # (stride, padding, dilation, groups) of the convolution: the same numbers

    def prepare(self, x, weight, bias):
        x = x.unsqueeze(0) if self.unbatched else x
        if not self.conv.runs_kernels:
            return x, weight, bias
        return self.conv.ready_input(x), self.conv.ready_weight(weight), bias

    def forward(self, x, weight, bias):
        conv = self.conv
        if not conv.runs_kernels:
            return _empty(conv.x_shape, x, conv.channels_last)
        y = conv.backward(x, None, weight, (True, False, False))[0]
        return y if bias is None else y.add_(bias.view(1, -1, 1, 1))

    def backward(self, dy, x, weight, needs):
        """(dx, dw, dbias) for `needs`; None where not asked. dx = conv2d(dy, w); dw: the convolution's, of input
        dy and output gradient x; dbias: dy summed in fp32."""
        conv = self.conv
        need_dx, need_dw, need_dbias = needs
        dbias = dy.sum((0, 2, 3), dtype=torch.float32).to(dy.dtype) if need_dbias else None
        if not conv.runs_kernels:
            return (_empty(x.shape, x, conv.channels_last) if need_dx else None,
                    torch.zeros_like(weight) if need_dw else None, dbias)
        dy = conv.ready_input(dy)
        dx = conv.forward(dy, weight, None) if need_dx else None
        dw = conv.backward(x, dy, weight, (False, True, False))[1] if need_dw else None
        return dx, dw, dbias

    def differentiable_grads(self, dy, x, weight, needs):
        """(dx, dw, dbias) for `needs` as differentiable nnkernels convolutions: dx = conv2d(dy, w), dw the
        convolution's with x as its output gradient, dbias dy's sum."""
        stride, padding, dilation, groups = self.args
        need_dx, need_dw, need_dbias = needs
        dx = conv2d(dy, weight, None, stride, padding, dilation, groups) if need_dx else None
        dw = conv2d_grads(x, dy, weight, *self.args, (False, True, False))[1] if need_dw else None
        return dx, dw, dy.sum((0, 2, 3)) if need_dbias else None


def _plan(x, weight, bias, stride, padding, output_padding, groups, dilation):
    """The plan of this call's signature, built (arguments checked) on its first call."""
    try:
        signature = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
                     weight.device, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                     stride, padding, output_padding, groups, dilation, torch.backends.cudnn.allow_tf32,
                     type(groups))
    except AttributeError:  # not tensors: the checks say which
        _check(x, weight, bias, stride, padding, output_padding, groups, dilation)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.build(signature, lambda: _new_plan(x, weight, bias, stride, padding, output_padding, groups,
                                                         dilation))
    return plan


def _new_plan(x, weight, bias, stride, padding, output_padding, groups, dilation):
    _check(x, weight, bias, stride, padding, output_padding, groups, dilation)
    unbatched = x.dim() == 3
    batch, _, height, width = (1, *x.shape) if unbatched else tuple(x.shape)
    c_in, per_group, kh, kw = weight.shape
    out = tuple(transposed_size((height, width)[axis], (kh, kw)[axis], stride[axis], padding[axis],
                                output_padding[axis], dilation[axis]) for axis in (0, 1))
    conv = Conv2dPlan((batch, per_group * groups, *out), tuple(weight.shape), False, x.dtype, x.device, stride,
                      padding, dilation, groups, False, channels_last_output(x, weight), _is_channels_last(weight))
    return ConvTranspose2dPlan(conv, bias is not None, unbatched)


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose2d on nnkernels' kernels (fp32, fp16, bf16; 3-D or 4-D input; autograd;
    autocast), the arguments in torch's order."""
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    output_padding, dilation = _pair(output_padding, "output_padding"), _pair(dilation, "dilation")
    if torch.compiler.is_compiling():
        unbatched = isinstance(input, Tensor) and input.dim() == 3
        y = conv_transpose2d_op(input.unsqueeze(0) if unbatched else input, weight, bias, list(stride), list(padding),
                                list(output_padding), groups, list(dilation))
        return y.squeeze(0) if unbatched else y
    if isinstance(input, Tensor):
        input, weight, bias = _autocast(input, weight, bias)
    plan = _plan(input, weight, bias, stride, padding, output_padding, groups, dilation)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return planned(input, weight, bias, plan)
    y = plan.forward(*plan.prepare(input, weight, bias))
    return y.squeeze(0) if plan.unbatched else y


# ---- the custom operators torch.compile sees ----

@operator("conv_transpose2d")
def conv_transpose2d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
                        output_padding: list[int], groups: int, dilation: list[int]) -> Tensor:
    """The forward custom op: a 4-D conv_transpose2d."""
    plan = _plan(x, weight, bias, tuple(stride), tuple(padding), tuple(output_padding), groups, tuple(dilation))
    return plan.forward(*plan.prepare(x, weight, bias))


@register_fake("conv_transpose2d")
def _conv_transpose2d_fake(x, weight, bias, stride, padding, output_padding, groups, dilation):
    _check(x, weight, bias, tuple(stride), tuple(padding), tuple(output_padding), groups, tuple(dilation))
    out = [transposed_size(x.shape[2 + axis], weight.shape[2 + axis], stride[axis], padding[axis],
                           output_padding[axis], dilation[axis]) for axis in (0, 1)]
    return _empty((x.shape[0], weight.shape[1] * groups, *out), x, channels_last_output(x, weight))


@operator("conv_transpose2d_backward", derivative=False)
def conv_transpose2d_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                                 output_padding: list[int], groups: int, dilation: list[int], need_dx: bool,
                                 need_dw: bool, need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias) of `nnkernels::conv_transpose2d`; a gradient not asked for comes back as an empty tensor."""
    plan = _plan(x, weight, None, tuple(stride), tuple(padding), tuple(output_padding), groups, tuple(dilation))
    x, weight, _ = plan.prepare(x, weight, None)
    grads = plan.backward(grad_y, x, weight, (need_dx, need_dw, need_dbias))
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)


@register_fake("conv_transpose2d_backward")
def _conv_transpose2d_backward_fake(grad_y, x, weight, stride, padding, output_padding, groups, dilation, need_dx,
                                    need_dw, need_dbias):
    return (_empty(x.shape, x, channels_last_output(x, weight)) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
            grad_y.new_empty(grad_y.shape[1]) if need_dbias else x.new_empty(0))


register_conv_autograd("conv_transpose2d")
register_conv_autocast("conv_transpose2d", conv_transpose2d_op)
register_kernels("conv_transpose2d", KERNELS["conv2d"])  # the convolution's plans, so its kernels
