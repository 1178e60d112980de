"""`conv2d`: torch.nn.functional.conv2d on nnkernels' kernels, with autograd, autocast and torch.compile.

A call's signature (shapes, strides, dtypes, devices, stride, padding, dilation, groups, TF32) finds its
`Conv2dPlan`; the first call with a signature checks the arguments and builds it. The plan's first forward,
and its first backward per set of gradients asked for, choose each pass's algorithm and config
(`conv_algorithms`, tuning where it must) and bind their kernels; every later call allocates and launches.

Eagerly, autograd goes through a `torch.autograd.Function` around the plan, torch's cheapest path. Under
`torch.compile` the same plans run inside two custom operators, `nnkernels::conv2d` and
`nnkernels::conv2d_backward` (fake implementations, autograd and autocast registered), so graphs trace with no
break. While a CUDA graph is captured, a backward runs dw on a side stream beside dx (`streams.side_by_side`).
Where torch's convolution would give a channels-last output (x or the weight channels-last), so does the plan:
the channels-last kernels read x and dy and write y and dx in that layout, other algorithms through copies.
`kernels_for(...)` names the kernels a call launches; `last_kernels("conv2d")` those the latest calls did.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import machine
from ..layer_shapes import ConvShape
from .common import (FLOAT_DTYPES, OPS, ArgumentError, PlanCache, aligned, building, direct_apply, elsewhere,
                     operator, record, register_autograd, register_fake, register_kernels)
from .conv_algorithms import dw_pass, dx_pass, forward_pass
from .double_backward import conv2d_grads
from .conv_problem import Problem, output_size, tf32_products
from .layout import (as_channels_last, channels_last_copy_kernels, channels_last_pair_copy, channels_last_pair_kernels,
                     nchw)
from .streams import side_by_side

INT32_LIMIT = 2**31
# One launch indexes its pixels (b, oh, ow) and (b, ih, iw) in int32; larger batches go in slices.
PIXEL_INDEX_LIMIT = 2**31
_AUTOCAST_DEVICES = ("cuda", "cpu")
_PLANS = PlanCache()


# ---- arguments (torch's semantics; errors name the argument) ----

def _pair(value, name):
    if type(value) is int:
        return (value, value)
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return value
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (int(value[0]), int(value[-1]))
    raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")


def _string_padding(x, weight, padding, dilation, stride):
    """(x, explicit padding) for padding 'valid' or 'same'; 'same' with an even span pads x's right and bottom
    by one more, as torch does."""
    if padding == "valid":
        return x, (0, 0)
    if padding != "same":
        raise ArgumentError(f"padding: expected 'valid', 'same', an int or a pair of ints, got {padding!r}")
    if stride != (1, 1):
        raise ArgumentError(f"padding: 'same' is not supported for strided convolutions (stride={stride})")
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
    extra = [t - t // 2 - t // 2 for t in totals]
    if any(extra) and isinstance(x, Tensor):
        x = torch.nn.functional.pad(x, (0, extra[1], 0, extra[0]))
    return x, tuple(t // 2 for t in totals)


def check_tensors(x, weight, bias, weight_layout):
    """The checks a convolution and a transposed one share: tensors where tensors are due, 3-D or 4-D input, a
    4-D weight (`weight_layout` says its dimensions), and one float dtype and device for all."""
    for name, tensor in (("input", x), ("weight", weight)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if x.dim() not in (3, 4):
        raise ArgumentError(f"input: expected a 3-D (unbatched) or 4-D (batched) tensor, got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ArgumentError(f"weight: expected a 4-D tensor {weight_layout}, got shape {tuple(weight.shape)}")
    tensors = [("input", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, tensor in tensors:
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {tensor.dtype}")
        if tensor.dtype != x.dtype:
            raise ArgumentError(f"{name}: expected dtype {x.dtype} like input, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ArgumentError(f"{name}: expected a tensor on {x.device} like input, got {tensor.device}")


def _check(x, weight, bias, stride, padding, dilation, groups):
    """Raise ValueError/TypeError naming the first bad argument. A value of the wrong type (float64 included) is a
    TypeError, arguments that disagree (dtypes, devices, channels) a ValueError."""
    check_tensors(x, weight, bias, "[C_OUT, C_IN/groups, KH, KW]")
    if type(groups) is not int or groups < 1:
        raise ArgumentError(f"groups: expected a positive int, got {groups!r}")
    batch, c_in, height, width = x.shape if x.dim() == 4 else (1, *x.shape)
    c_out, cin_per_group, kh, kw = weight.shape
    if c_out % groups:
        raise ArgumentError(f"groups: {groups} does not divide the weight's {c_out} output channels")
    if c_in % groups:
        raise ArgumentError(f"groups: {groups} does not divide the input's {c_in} channels")
    if cin_per_group * groups != c_in:
        raise ArgumentError(f"input: expected {cin_per_group * groups} channels (weight's {cin_per_group} per group x "
                         f"groups={groups}), got {c_in}")
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ArgumentError(f"bias: expected shape ({c_out},), got {tuple(bias.shape)}")
    if min(x.shape[-3:]) < 1 or min(weight.shape) < 1:
        raise ArgumentError(f"input/weight: expected non-empty tensors (the batch may be 0), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    for name, values, low in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if min(values) < low:
            raise ArgumentError(f"{name}: expected values >= {low}, got {tuple(values)}")
    for axis, size, kernel, pad, dil in (("height", height, kh, padding[0], dilation[0]),
                                         ("width", width, kw, padding[1], dilation[1])):
        span = dil * (kernel - 1) + 1
        if size + 2 * pad < span:
            raise ArgumentError(f"weight: kernel {axis} {kernel} (dilated to {span}) is larger than the padded input "
                             f"{axis} {size} + 2*{pad} = {size + 2 * pad}")
    out_pixels = (output_size(height, kh, stride[0], padding[0], dilation[0])
                  * output_size(width, kw, stride[1], padding[1], dilation[1]))
    if c_in * height * width >= INT32_LIMIT or weight.numel() >= INT32_LIMIT or c_out * out_pixels >= INT32_LIMIT:
        raise ArgumentError("input: one image (C_IN*H*W), one output image (C_OUT*OH*OW) and the weight must each "
                         "hold fewer than 2**31 elements")


def _ready(tensor):
    """`tensor` as the kernels read it: contiguous, on a 16-byte aligned address (a copy where it is not)."""
    return aligned(nchw(tensor))


def _ready_channels_last(tensor):
    """`tensor` as a channels-last plan's kernels read it: channels-last, 16-byte aligned (a copy where not)."""
    return aligned(as_channels_last(tensor))


def _is_channels_last(t):
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def channels_last_output(x, weight):
    """Whether torch's convolution gives this call a channels-last output, as cuDNN decides it: where x or the
    weight is stored channels-last (and not also contiguous)."""
    return x.dim() == 4 and (_is_channels_last(x) or _is_channels_last(weight))


def _empty(shape, like, channels_last):
    return torch.empty(shape, dtype=like.dtype, device=like.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _autocast(x, weight, bias):
    """Under autocast, floating inputs in the active autocast dtype (as torch's convolution takes them)."""
    device_type = x.device.type
    if device_type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(tensor):
        eligible = tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float64
        return tensor.to(dtype) if eligible else tensor

    return cast(x), cast(weight), cast(bias)


# ---- plans ----

def _batch_chunks(batch, pixels_per_image):
    """Slices of the batch, [first, end), each small enough for the kernels' int32 pixel index; a single slice
    unless the batch holds 2**31 pixels or more."""
    step = max(1, (PIXEL_INDEX_LIMIT - 1) // pixels_per_image)
    return [(first, min(first + step, batch)) for first in range(0, batch, step)]


class Conv2dPlan:
    """What every call with one signature runs: `forward(x, weight, bias)` and `backward(dy, x, weight, needs)`, on
    tensors `prepare` made ready (4-D, aligned, contiguous; x channels-last in a `channels_last` plan, whose y, dy
    and dx are channels-last too; the weight channels-last where the plan's forward reads it so, `weight_nhwc`).
    Built from checked arguments."""

    def __init__(self, x_shape, w_shape, has_bias, dtype, device, stride, padding, dilation, groups, unbatched=False,
                 channels_last=False, weight_channels_last=False):
        self.unbatched, self.channels_last, self.weight_channels_last = unbatched, channels_last, weight_channels_last
        self.x_shape, self.w_shape, self.has_bias, self.dtype, self.device = x_shape, w_shape, has_bias, dtype, device
        self.args = (stride, padding, dilation, groups)
        self.y_shape = (x_shape[0], w_shape[0], output_size(x_shape[2], w_shape[2], stride[0], padding[0], dilation[0]),
                        output_size(x_shape[3], w_shape[3], stride[1], padding[1], dilation[1]))
        # A plan runs no kernel for an empty batch or on meta tensors: it only allocates.
        self.runs_kernels = x_shape[0] > 0 and device.type != "meta"
        self.tf32 = tf32_products(dtype, device.type)
        pixels = max(x_shape[2] * x_shape[3], self.y_shape[2] * self.y_shape[3])
        self.chunks = _batch_chunks(x_shape[0], pixels) if self.runs_kernels else [(0, x_shape[0])]
        self.parts = {}
        if len(self.chunks) > 1:
            for n in dict.fromkeys(end - first for first, end in self.chunks):
                self.parts[n] = Conv2dPlan((n, *x_shape[1:]), w_shape, has_bias, dtype, device, *self.args,
                                           channels_last=channels_last, weight_channels_last=weight_channels_last)
        # A channels-last weight the forward reads as it lies (no copy); the backward's dx takes it NCHW.
        self.weight_nhwc = self.problem(has_bias).w_nhwc
        self.layer_call = ConvShape(tuple(x_shape), tuple(w_shape), tuple(stride), tuple(padding), tuple(dilation),
                                    groups, has_bias, channels_last)  # the job that compiles ahead for this call
        self._forward = None
        self._forward_ids = None
        self._backward = {}

    def problem(self, has_bias):
        stride, padding, dilation, groups = self.args
        return Problem(self.x_shape, self.w_shape, stride, padding, dilation, groups, self.dtype, has_bias,
                       machine.machine_of(self.device), tf32=self.tf32, device=self.device, nhwc=self.channels_last,
                       w_nhwc=self.weight_channels_last)

    def prepare(self, x, weight, bias):
        if self.unbatched:
            x = x.unsqueeze(0)
        if not self.runs_kernels:
            return x, weight, bias
        return self.ready_input(x), self.ready_weight(weight), None if bias is None else _ready(bias)

    def ready_input(self, t):
        """x (or dy) as this plan's kernels read it: channels-last or contiguous, aligned."""
        return _ready_channels_last(t) if self.channels_last else _ready(t)

    def ready_weight(self, weight):
        return aligned(weight) if self.weight_nhwc else _ready(weight)

    def forward(self, x, weight, bias):
        if not self.runs_kernels:
            return _empty(self.y_shape, x, self.channels_last)
        switch = elsewhere(self.device)
        if switch is not None:
            with switch:
                return self.forward(x, weight, bias)
        if len(self.chunks) > 1:
            return torch.cat([self.parts[end - first].forward(x[first:end], weight, bias)
                              for first, end in self.chunks])
        run = self._forward
        if run is None:
            return self._first_forward(x, weight, bias)
        record("conv2d", "forward", self._forward_ids)
        return run(x, weight, bias)

    def _first_forward(self, x, weight, bias):
        with building("conv2d", "forward", self.x_shape, [(self.layer_call, "forward")]):
            if self._forward is None:
                _, self._forward, self._forward_ids = _tuned(forward_pass(self.problem(self.has_bias)),
                                                             lambda run: run(x, weight, bias))
            return self.forward(x, weight, bias)  # its first launches compile what no candidate timed

    def backward(self, dy, x, weight, needs):
        """(dx, dw, dbias) for `needs` = which of (dx, dw, dbias) are asked for; None where not asked. x may be None
        where only dx is (a transposed convolution's forward)."""
        if not self.runs_kernels:
            return (_empty(self.x_shape, dy, self.channels_last) if needs[0] else None,
                    torch.zeros_like(weight) if needs[1] else None,
                    weight.new_zeros(weight.shape[0]) if needs[2] else None)
        switch = elsewhere(self.device)
        if switch is not None:
            with switch:
                return self.backward(dy, x, weight, needs)
        dy = self.ready_input(dy)
        if self.weight_nhwc and needs[0]:
            weight = _ready(weight)
        if len(self.chunks) > 1:
            parts = [self.parts[end - first].backward(dy[first:end], None if x is None else x[first:end], weight,
                                                      needs)
                     for first, end in self.chunks]
            dx = torch.cat([part[0] for part in parts]) if needs[0] else None
            # The chunks' weight gradients add up in a fixed order, in fp32: still deterministic.
            dw, dbias = (sum(part[i].float() for part in parts).to(self.dtype) if needs[i] else None for i in (1, 2))
            return dx, dw, dbias
        run = self._backward.get(needs)
        if run is None:
            return self._first_backward(dy, x, weight, needs)
        record("conv2d", "backward", run.ids)
        return run(dy, x, weight)

    def differentiable_grads(self, dy, x, weight, needs):
        """(dx, dw, dbias) for `needs`, as differentiable nnkernels convolutions (create_graph=True)."""
        return conv2d_grads(dy, x, weight, *self.args, needs)

    def _first_backward(self, dy, x, weight, needs):
        parts = {"dx": needs[0], "dw": needs[1] or needs[2]}
        jobs = [(self.layer_call, part) for part, needed in parts.items() if needed]
        unneeded = [(self.layer_call, part) for part, needed in parts.items() if not needed]
        with building("conv2d", "backward", self.x_shape, jobs, unneeded):
            if needs not in self._backward:
                self._backward[needs] = _backward_runner(self.problem(needs[2]), needs, dy, x, weight)
            return self.backward(dy, x, weight, needs)  # its first launches compile what no candidate timed


def _tuned(pass_, time_with):
    """(choice, runner, kernel ids) of the choice `pass_` makes; `time_with(runner)` runs a candidate on the first
    call's tensors while tuning times it."""
    runners = {}

    def runner_of(choice):
        if choice not in runners:
            runners[choice] = pass_.runner(choice)
        return runners[choice]

    choice = pass_.choose(lambda candidate: time_with(runner_of(candidate)))
    return choice, runner_of(choice), [k.id for k in pass_.kernels(choice)]


class _BackwardRunner:
    """dx and dw (with dbias) of one backward. Where both read dy channels-last, one launch copies dy and x (which
    the channels-last dw reads too) for both: `copy_operands(dy, x)` -> (dy_cl, x_cl)."""

    def __init__(self, dx_run, dw_run, copy_operands, device, ids):
        self.dx_run, self.dw_run, self.copy_operands, self.device, self.ids = dx_run, dw_run, copy_operands, device, ids

    def __call__(self, dy, x, weight):
        copies = self.copy_operands(dy, x) if self.copy_operands is not None else None
        dy_cl = copies[0] if copies is not None else None
        dx_run, dw_run = self.dx_run, self.dw_run
        if dx_run is not None and dw_run is not None:
            dx, (dw, dbias) = side_by_side(self.device, lambda: dx_run(dy, weight, dy_cl),
                                           lambda: dw_run(dy, x, copies))
            return dx, dw, dbias
        if dx_run is not None:
            return dx_run(dy, weight, None), None, None
        return (None, *dw_run(dy, x, None))


def _backward_runner(p, needs, dy, x, weight):
    """The backward of problem p for `needs`: dx and dw chosen each on its own (tuned on the first call's tensors,
    each making its own copies while timed), then run sharing dy's channels-last copy where both read one."""
    need_dx, need_dw, need_dbias = needs
    ids, dx_run, dw_run, reads = [], None, None, []
    if need_dx:
        dx = dx_pass(p)
        if dx.problem is p:
            choice, dx_run, dx_ids = _tuned(dx, lambda run: run(dy, weight, None))
        else:  # dx as the forward of the transposed problem: dy is its input, the weight the convolution's own
            choice, forward, dx_ids = _tuned(dx, lambda run: run(dy, weight, None))
            dx_run = _as_dx(forward)
        reads.append(dx.reads_channels_last(choice))
        ids += dx_ids
    if need_dw or need_dbias:
        dw = dw_pass(p)
        choice, dw_run, dw_ids = _tuned(dw, lambda run: run(dy, x, None))
        reads.append(dw.reads_channels_last(choice))
        ids += dw_ids
        if not need_dw:
            dw_run = _bias_only(dw_run)
    shares = len(reads) == 2 and all(reads)
    copy_operands = channels_last_pair_copy(p.y_shape, p.x_shape, p.dtype, p.device) if shares else None
    return _BackwardRunner(dx_run, dw_run, copy_operands, p.device, _shared(p, dx_ids, dw_ids) if shares else ids)


def _shared(p, dx_ids, dw_ids):
    """The kernel ids of a backward whose dx and dw both read dy channels-last: the one launch that copies dy and x,
    then dx's kernels less its copy of dy, then dw's less its copies of dy and x."""
    dy_copy, x_copy = ([k.id for k in channels_last_copy_kernels(shape, p.dtype)] for shape in (p.y_shape, p.x_shape))

    def without(ids, copies):
        ids = list(ids)
        for copy in copies:  # none for an empty tensor
            ids.remove(copy)
        return ids

    return ([k.id for k in channels_last_pair_kernels(p.y_shape, p.x_shape, p.dtype)] + without(dx_ids, dy_copy)
            + without(dw_ids, dy_copy + x_copy))


def _as_dx(forward_run):
    return lambda dy, weight, dy_cl: forward_run(dy, weight, None, dy_cl)


def _bias_only(dw_run):
    def run(dy, x, copies):
        return None, dw_run(dy, x, copies)[1]

    return run


def _plan(x, weight, bias, stride, padding, dilation, groups):
    """The plan of this call's signature, built (arguments checked) on its first call."""
    if type(groups) is not int:  # 2.0 == 2 would find the plan of groups=2
        _check(x, weight, bias, stride, padding, dilation, groups)
    try:
        signature = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
                     weight.device, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                     stride, padding, dilation, groups, torch.backends.cudnn.allow_tf32)
    except AttributeError:  # not tensors: the checks say which
        _check(x, weight, bias, stride, padding, dilation, groups)
        raise
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.build(signature, lambda: _new_plan(x, weight, bias, stride, padding, dilation, groups))
    return plan


def _new_plan(x, weight, bias, stride, padding, dilation, groups):
    _check(x, weight, bias, stride, padding, dilation, groups)
    unbatched = x.dim() == 3
    return Conv2dPlan((1, *x.shape) if unbatched else tuple(x.shape), tuple(weight.shape), bias is not None, x.dtype,
                      x.device, stride, padding, dilation, groups, unbatched, channels_last_output(x, weight),
                      _is_channels_last(weight))


class _Planned(torch.autograd.Function):
    """Eager autograd around a convolution's plan (`Conv2dPlan`, or `ConvTranspose2dPlan` for a transposed one).
    The forward saves the tensors the plan made ready, which its backward reads, and the caller's x and weight
    (the same tensors where nothing was copied), through which a differentiable backward (create_graph=True)
    reaches the caller's graph; the backward asks the plan for the gradients autograd needs, or for them as
    differentiable convolutions (`differentiable_grads`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan):
        ready_x, ready_weight, ready_bias = plan.prepare(x, weight, bias)
        ctx.save_for_backward(ready_x, ready_weight, x, weight)
        ctx.plan = plan
        y = plan.forward(ready_x, ready_weight, ready_bias)
        return y.squeeze(0) if plan.unbatched else y

    @staticmethod
    def backward(ctx, dy):
        ready_x, ready_weight, x, weight = ctx.saved_tensors
        plan = ctx.plan
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and plan.has_bias)
        dy = dy.unsqueeze(0) if plan.unbatched else dy
        if torch.is_grad_enabled():  # create_graph=True: gradients as differentiable convolutions, not the plan's
            dx, dw, dbias = plan.differentiable_grads(dy, x.unsqueeze(0) if plan.unbatched else x, weight, needs)
        else:
            dx, dw, dbias = plan.backward(dy, ready_x, ready_weight, needs)
        return (dx.squeeze(0) if plan.unbatched and dx is not None else dx), dw, dbias, None


planned = direct_apply(_Planned)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d on nnkernels' kernels (fp32, fp16, bf16; 3-D or 4-D input; autograd; autocast)."""
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    if isinstance(padding, str):
        input, padding = _string_padding(input, weight, padding, dilation, stride)
    else:
        padding = _pair(padding, "padding")
    if torch.compiler.is_compiling():
        return _traced(input, weight, bias, stride, padding, dilation, groups)
    if isinstance(input, Tensor):
        input, weight, bias = _autocast(input, weight, bias)
    plan = _plan(input, weight, bias, stride, padding, dilation, groups)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return planned(input, weight, bias, plan)
    y = plan.forward(*plan.prepare(input, weight, bias))
    return y.squeeze(0) if plan.unbatched else y


def _traced(x, weight, bias, stride, padding, dilation, groups):
    """conv2d as torch.compile traces it: the custom operator (4-D), its checks run on the traced tensors."""
    unbatched = isinstance(x, Tensor) and x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
    y = torch.ops.nnkernels.conv2d(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    return y.squeeze(0) if unbatched else y


# ---- the custom operators torch.compile sees ----

@operator("conv2d")
def conv2d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> Tensor:
    """The forward custom op: a 4-D conv2d (see `conv2d`, which also takes 3-D input and string padding)."""
    plan = _plan(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
    return plan.forward(*plan.prepare(x, weight, bias))


@register_fake("conv2d")
def _conv2d_fake(x, weight, bias, stride, padding, dilation, groups):
    _check(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
    oh = output_size(x.shape[2], weight.shape[2], stride[0], padding[0], dilation[0])
    ow = output_size(x.shape[3], weight.shape[3], stride[1], padding[1], dilation[1])
    return _empty((x.shape[0], weight.shape[0], oh, ow), x, channels_last_output(x, weight))


@operator("conv2d_backward", derivative=False)
def conv2d_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                       dilation: list[int], groups: int, need_dx: bool, need_dw: bool,
                       need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias) of `nnkernels::conv2d`; a gradient not asked for comes back as an empty tensor."""
    plan = _plan(x, weight, None, tuple(stride), tuple(padding), tuple(dilation), groups)
    x, weight, _ = plan.prepare(x, weight, None)
    grads = plan.backward(grad_y, x, weight, (need_dx, need_dw, need_dbias))
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)


@register_fake("conv2d_backward")
def _conv2d_backward_fake(grad_y, x, weight, stride, padding, dilation, groups, need_dx, need_dw, need_dbias):
    return (_empty(x.shape, x, channels_last_output(x, weight)) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_dbias else x.new_empty(0))


def register_conv_autograd(name: str):
    """Autograd of custom op `nnkernels::<name>` (x, weight, bias, then options): its backward is the custom op
    `nnkernels::<name>_backward(grad_y, x, weight, *options, need_dx, need_dw, need_dbias)`, which gives an empty
    tensor for a gradient not asked for."""

    def setup_context(ctx, inputs, output):
        x, weight, bias, *options = inputs
        ctx.save_for_backward(x, weight)
        ctx.options = options
        ctx.has_bias = bias is not None

    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
        need_dbias = need_dbias and ctx.has_bias
        backward_op = getattr(torch.ops.nnkernels, f"{name}_backward")
        dx, dw, dbias = backward_op(grad_y, x, weight, *ctx.options, need_dx, need_dw, need_dbias)
        return ((dx if need_dx else None, dw if need_dw else None, dbias if need_dbias else None)
                + (None,) * len(ctx.options))

    register_autograd(name, backward, setup_context)


register_conv_autograd("conv2d")


def register_conv_autocast(name: str, op):
    """Under autocast, custom op `nnkernels::<name>` (`op`, taking x, weight, bias, then options) casts its floating
    tensors to the *active* autocast dtype (as torch's convolutions do), then runs with autocast off.
    `torch.library.register_autocast` fixes one dtype at registration, so the rule is registered by hand on each
    Autocast<device> key, the way torch registers its own."""
    for device_type in _AUTOCAST_DEVICES:
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))

        def autocast_op(keyset, x, weight, bias, *options, device_type=device_type, excluded=excluded):
            dtype = torch.get_autocast_dtype(device_type)

            def cast(tensor):
                eligible = tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float64
                return tensor.to(dtype) if eligible else tensor

            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return op(cast(x), cast(weight), cast(bias), *options)

        OPS.impl(name, autocast_op, key_name, with_keyset=True)


register_conv_autocast("conv2d", conv2d_op)


# ---- what a call launches ----

def _listed_problem(x_shape, weight_shape, stride, padding, dilation, groups, dtype, bias, channels_last=False,
                    weight_channels_last=False):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Problem(x_shape, weight_shape, _pair(stride, "stride"), _pair(padding, "padding"),
                   _pair(dilation, "dilation"), groups, dtype, bias, machine.machine_of(device),
                   tf32=tf32_products(dtype, device.type), device=device, nhwc=channels_last,
                   w_nhwc=weight_channels_last)


def kernels_for(x_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1, dtype=torch.float32,
                bias=False, backward=True, channels_last=False, weight_channels_last=False) -> list[str]:
    """The ids of the kernels `conv2d` launches for this call (forward, then dx, then dw and its reduce when
    `backward`; `channels_last`: x, and so y, dy and dx, channels-last; `weight_channels_last`: the weight stored
    channels-last too, as `model.to(memory_format=torch.channels_last)` leaves it), with the choices tuning has
    remembered or, before any tuning, the first guesses."""
    p = _listed_problem(x_shape, weight_shape, stride, padding, dilation, groups, dtype, bias,
                        channels_last or weight_channels_last, weight_channels_last)
    passes = [forward_pass(p)] + ([dx_pass(p), dw_pass(p)] if backward else [])
    choices = [pass_.peek() for pass_ in passes]
    ids = [[k.id for k in pass_.kernels(choice)] for pass_, choice in zip(passes, choices)]
    if backward and all(pass_.reads_channels_last(choice) for pass_, choice in zip(passes[1:], choices[1:])):
        return ids[0] + _shared(p, *ids[1:])
    return [k for pass_ids in ids for k in pass_ids]


def remembered_choices(x_shape, weight_shape, stride, padding, dilation, groups, dtype, bias,
                       channels_last=False) -> tuple:
    """(forward, dx, dw): per pass the choice tuning remembers for this call (x and the weight channels-last with
    `channels_last`), None where it remembers none. Beside the code and versions, these decide which kernels
    `precompile` compiles: the remembered choice, else the quick candidates."""
    p = _listed_problem(x_shape, weight_shape, stride, padding, dilation, groups, dtype, bias, channels_last,
                        channels_last)
    return tuple(pass_.remembered() for pass_ in (forward_pass(p), dx_pass(p), dw_pass(p)))


def precompile(x, weight, stride=1, padding=0, dilation=1, groups=1, bias=False, backward=True, full=False,
               forward=True, backward_passes=("dx", "dw")):
    """Run once each, on scratch outputs, every choice `conv2d` could make for this call, timing and remembering
    nothing: per pass (the forward with `forward`, with `backward` those of `backward_passes`, dx and dw) the choice
    tuning remembers (this machine's cache or the shipped table) where there is one, else those quick tuning times
    (all with `full`).
    Triton then has them all in its disk cache, so another process (one that trains or tunes) loads them instead
    of compiling. A channels-last x or weight compiles the channels-last choices, as `conv2d` would run them."""
    from .. import tuning

    if not set(backward_passes) <= {"dx", "dw"}:
        raise ValueError(f"backward_passes: expected passes among 'dx' and 'dw', got {backward_passes!r}")
    count = None if full else tuning.QUICK_CANDIDATES

    def choices(pass_):
        known = None if full else pass_.remembered()
        return [known] if known is not None else pass_.candidates()[:count]

    for name, _, call in choice_calls(x, weight, stride, padding, dilation, groups, bias, backward, choices):
        if forward if name == "forward" else name in backward_passes:
            call()


def choice_calls(x, weight, stride=1, padding=0, dilation=1, groups=1, bias=False, backward=True, choices=None,
                 dy=None):
    """[(pass, choice, call)]: per pass ("forward", then "dx" and "dw" with `backward`) each of `choices(pass_)`
    (default: every candidate), `call()` running that choice's runner once, as `conv2d` would for this call, on
    x, the weight (and a zero bias, with `bias`) and dy (uninitialised unless given), returning y, dx or (dw, dbias),
    new each call. What `precompile` compiles and what a tool times candidate by candidate."""
    p = _listed_problem(x.shape, weight.shape, stride, padding, dilation, groups, x.dtype, bias,
                        channels_last_output(x, weight), _is_channels_last(weight))
    p.device = x.device
    x = _ready_channels_last(x) if p.nhwc else _ready(x)
    forward_weight, weight = (aligned(weight) if p.w_nhwc else _ready(weight)), _ready(weight)  # dx reads it NCHW
    bias_arg = torch.zeros(p.C_OUT, dtype=x.dtype, device=x.device) if bias else None
    dy = _empty(p.y_shape, x, p.nhwc) if dy is None else (_ready_channels_last(dy) if p.nhwc else _ready(dy))
    choices = choices or (lambda pass_: pass_.candidates())
    forward = forward_pass(p)
    calls = [("forward", choice, functools.partial(forward.runner(choice), x, forward_weight, bias_arg))
             for choice in choices(forward)]
    if not backward:
        return calls
    dx = dx_pass(p)
    for choice in choices(dx):
        run = dx.runner(choice)
        dx_run = _as_dx(run) if dx.problem is not p else run
        calls.append(("dx", choice, functools.partial(dx_run, dy, weight, None)))
    dw = dw_pass(p)
    calls += [("dw", choice, functools.partial(dw.runner(choice), dy, x, None)) for choice in choices(dw)]
    return calls


def _conv_kernel_classes():
    from ..kernel import catalogue
    from ..ops.common.layout import ChannelsLastCopy, ChannelsLastCopyPair

    return tuple(cls for cls in catalogue() if cls.__module__.startswith("nnkernels.ops.conv2d.") and not cls.seed) + (
        ChannelsLastCopy, ChannelsLastCopyPair)


register_kernels("conv2d", _conv_kernel_classes())
