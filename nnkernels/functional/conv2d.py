"""`conv2d`: torch.nn.functional.conv2d's semantics on nnkernels' kernels.

The work runs in two PyTorch custom operators, so autograd, `torch.compile` and autocast see
one opaque op each: `nnkernels::conv2d` (forward) and `nnkernels::conv2d_backward` (dx, dw,
dbias, each only when asked). Per shape the op picks its kernels from the catalogue (the plan,
`conv2d_plan.Problem`, holds the choice and the thresholds it rests on): the direct
depthwise kernels when groups == C_IN == C_OUT, a per-image matrix product for unpadded 1x1 convolutions
(of the subsampled input when strided), the implicit-GEMM tensor-core kernels otherwise, except for
one-group convolutions with at most 4 input channels and large output planes (the RGB stem): their
forward one output row per program on the GPU (16-bit and full fp32), their backward 1x1 products of the
unfolded input (im2col) for dw, and for dx 1x1 products folded back from fp32 columns. The implicit-GEMM
kernels run on channels-last copies (vector loads) when groups == 1 and the channel counts are multiples
of 16 (for dx only C_OUT must be; a stride-1 dx is the forward kernel run on dy with the transposed
weight, a strided one is written channels-last, then transposed; at stride 1 on Hopper and later the
forward also from TMA boxes, tuning's first guess on planes of at most 256 pixels, and dw from TMA
boxes, but in fp32 on planes of at most 256 pixels (4096 with TF32 off) as one 1x1 product of the input
unfolded rows-outer), straight from NCHW else. With TF32 off, the 3x3 stride-1 layers of 64 channels or more on
planes of at most 64x64 also offer tuning Winograd F(2x2, 3x3) (`functional.winograd`) for the forward, dx
and dw.
While a CUDA graph is captured, the backward runs dw (and its reduce) on a side stream beside dx
(`streams.side_by_side`).
Block sizes come from `nnkernels.tuning`. `kernels_for(...)` names the kernels a call uses,
and every launch is logged at DEBUG level on the "nnkernels" logger.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from .. import tuning
from ..ops.conv2d.channels_last import Conv2dGemmClDw, Conv2dGemmClForward
from ..ops.conv2d.channels_last_dx import Conv2dGemmClDx
from ..ops.conv2d.depthwise import Conv2dDepthwiseDw, Conv2dDepthwiseDx, Conv2dDepthwiseForward
from ..ops.conv2d.partials import Conv2dDwReduce, dw_partial_size
from ..ops.conv2d.gemm_dw import Conv2dGemmDw
from ..ops.conv2d.gemm_dx import Conv2dGemmDx
from ..ops.conv2d.gemm_forward import Conv2dGemmForward
from ..ops.conv2d.pointwise import Conv2dPointwise, Conv2dPointwiseDw, Conv2dPointwiseFp32Out
from ..ops.conv2d.rows_forward import Conv2dRowsForward
from ..ops.conv2d.tma_dw import Conv2dTmaDw
from ..ops.conv2d.tma_forward import Conv2dTmaForward
from ..ops.conv2d.winograd_transforms import (
    Conv2dWinogradDy,
    Conv2dWinogradInput,
    Conv2dWinogradOutput,
    Conv2dWinogradWeight,
)
from ..ops.conv2d.winograd_products import Conv2dWinogradDwFinish, Conv2dWinogradProducts
from ..ops.common.layout import ChannelsLastCopy, ChannelsLastCopyPair
from ..ops.conv2d.subsample import Subsample2dBackward, Subsample2dForward
from ..ops.conv2d.unfold import Fold2d, Unfold2d
from . import winograd
from .conv2d_plan import ROWS_OUTER_COPY, Problem, output_size
from .layout import channels_first, channels_last, channels_last_pair, subsample_backward
from .streams import side_by_side
from .unfold import fold_into, unfold

# The kernel classes this op launches (what `nnkernels list` shows against conv2d).
KERNELS = (
    Conv2dPointwise,
    Conv2dPointwiseDw,
    Conv2dPointwiseFp32Out,
    Unfold2d,
    Fold2d,
    Conv2dGemmClForward,
    Conv2dTmaForward,
    Conv2dGemmClDx,
    Conv2dGemmClDw,
    Conv2dTmaDw,
    Conv2dRowsForward,
    Conv2dGemmForward,
    Conv2dGemmDx,
    Conv2dGemmDw,
    Conv2dDwReduce,
    Conv2dDepthwiseForward,
    Conv2dDepthwiseDx,
    Conv2dDepthwiseDw,
    ChannelsLastCopy,
    ChannelsLastCopyPair,
    Subsample2dForward,
    Subsample2dBackward,
    Conv2dWinogradWeight,
    Conv2dWinogradInput,
    Conv2dWinogradProducts,
    Conv2dWinogradOutput,
    Conv2dWinogradDy,
    Conv2dWinogradDwFinish,
)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_LIMIT = 2**31
# One launch indexes its pixels (b, oh, ow) and (b, ih, iw) in int32; larger batches go in slices.
PIXEL_INDEX_LIMIT = 2**31

_log = logging.getLogger("nnkernels")


# ---- argument checks (torch's semantics, ValueError/TypeError naming the argument) ----

def _pair(value, name):
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (value[0], value[-1])
    raise TypeError(f"{name}: expected an int or a pair of ints, got {value!r}")


def _check(x, weight, bias, stride, padding, dilation, groups, *, same_dtype=True):
    """Raise ValueError/TypeError naming the first bad argument; return nothing. A value of the wrong type
    (float64 included) is a TypeError, arguments that disagree (dtypes, devices, channels) a ValueError."""
    for name, tensor in (("input", x), ("weight", weight)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if x.dim() != 4:
        raise ValueError(f"input: expected a 3-D (unbatched) or 4-D (batched) tensor, got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight: expected a 4-D tensor [C_OUT, C_IN/groups, KH, KW], got shape {tuple(weight.shape)}")
    tensors = [("input", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, tensor in tensors:
        if same_dtype and tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {tensor.dtype}")
        if same_dtype and tensor.dtype != x.dtype:
            raise ValueError(f"{name}: expected dtype {x.dtype} like input, got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} like input, got {tensor.device}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups!r}")
    batch, c_in, height, width = x.shape
    c_out, cin_per_group, kh, kw = weight.shape
    if c_out % groups:
        raise ValueError(f"groups: {groups} does not divide the weight's {c_out} output channels")
    if c_in % groups:
        raise ValueError(f"groups: {groups} does not divide the input's {c_in} channels")
    if cin_per_group * groups != c_in:
        raise ValueError(
            f"input: expected {cin_per_group * groups} channels (weight's {cin_per_group} per group x groups="
            f"{groups}), got {c_in}"
        )
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ValueError(f"bias: expected shape ({c_out},), got {tuple(bias.shape)}")
    if min(x.shape[1:]) < 1 or min(weight.shape) < 1:
        raise ValueError(
            f"input/weight: expected non-empty tensors (the batch may be 0), got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    for name, values, low in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if min(values) < low:
            raise ValueError(f"{name}: expected values >= {low}, got {tuple(values)}")
    for axis, size, kernel, pad, dil in (("height", height, kh, padding[0], dilation[0]),
                                         ("width", width, kw, padding[1], dilation[1])):
        span = dil * (kernel - 1) + 1
        if size + 2 * pad < span:
            raise ValueError(
                f"weight: kernel {axis} {kernel} (dilated to {span}) is larger than the padded input {axis} "
                f"{size} + 2*{pad} = {size + 2 * pad}"
            )
    out_pixels = (output_size(height, kh, stride[0], padding[0], dilation[0])
                  * output_size(width, kw, stride[1], padding[1], dilation[1]))
    if c_in * height * width >= INT32_LIMIT or weight.numel() >= INT32_LIMIT or c_out * out_pixels >= INT32_LIMIT:
        raise ValueError("input: one image (C_IN*H*W), one output image (C_OUT*OH*OW) and the weight must each "
                         "hold fewer than 2**31 elements")


def _padding(padding, weight, dilation, stride):
    """Explicit (pad_h, pad_w) and the extra right/bottom padding 'same' needs for even spans."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(f"padding: 'same' is not supported for strided convolutions (stride={stride})")
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            return tuple(t // 2 for t in totals), tuple(t - t // 2 - t // 2 for t in totals)
        raise ValueError(f"padding: expected 'valid', 'same', an int or a pair of ints, got {padding!r}")
    return _pair(padding, "padding"), (0, 0)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d on nnkernels' kernels (NCHW; fp32, fp16, bf16; autograd; autocast)."""
    stride = _pair(stride, "stride")
    dilation = _pair(dilation, "dilation")
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    padding, extra = _padding(padding, weight, dilation, stride)
    unbatched = isinstance(x, Tensor) and x.dim() == 3
    if unbatched:
        x = x.unsqueeze(0)
    if isinstance(x, Tensor) and any(extra):
        x = torch.nn.functional.pad(x, (0, extra[1], 0, extra[0]))
    autocast = isinstance(x, Tensor) and torch.is_autocast_enabled(x.device.type)
    _check(x, weight, bias, stride, padding, dilation, groups, same_dtype=not autocast)
    y = torch.ops.nnkernels.conv2d(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    return y.squeeze(0) if unbatched else y


# ---- kernel choice ----

def _launch(kernel, *args):
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("conv2d launches %s", kernel.id)
    kernel.launch(*args)


def _cl_forward_kernels(problem, device):
    """The channels-last forward kernel tuning has remembered for `problem` (or its first guess), and the
    split-K sum after it when that config splits."""
    config = tuning.peek("conv2d_cl_forward", problem.key, problem.cl_forward_candidates(device))
    if config.winograd:
        return winograd.forward_kernels(config, problem.has_bias, problem.flip_taps)
    kernels = [problem.cl_forward_kernel(config)]
    if config.split > 1:
        kernels.append(problem.split_sum_kernel(problem.B * problem.C_OUT * problem.OH * problem.OW))
    return kernels


def kernels_for(x_shape, weight_shape, stride=1, padding=0, dilation=1, groups=1, dtype=torch.float32,
                bias=False, backward=True) -> list[str]:
    """The ids of the kernels `conv2d` launches for this call (forward, then dx, dw, reduce when
    `backward`), with the block sizes tuning has remembered for it or, before any tuning, its heuristic's."""
    problem = Problem(x_shape, weight_shape, _pair(stride, "stride"), _pair(padding, "padding"),
                       _pair(dilation, "dilation"), groups, dtype, bias)
    if problem.depthwise:
        kernels = [problem.depthwise_forward_kernel()]
        if backward:
            kernels += [problem.depthwise_dx_kernel(), problem.depthwise_dw_kernel(bias), problem.reduce_kernel(bias)]
        return [k.id for k in kernels]
    if problem.pointwise:
        kernels = [problem.pointwise_kernel(tuning.peek("conv2d_pointwise", problem.key, problem.pointwise_candidates()))]
        if backward:
            dx_config = tuning.peek("conv2d_pointwise_dx", problem.key, problem.pointwise_candidates(for_dx=True))
            dw_config = tuning.peek("conv2d_pointwise_dw", problem.key + (bias,), problem.pointwise_dw_candidates())
            kernels += [problem.pointwise_kernel(dx_config, for_dx=True), problem.pointwise_dw_kernel(dw_config, bias),
                        problem.reduce_kernel(bias)]
        return [k.id for k in kernels]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if problem.forward_channels_last:
        kernels = _cl_forward_kernels(problem, device)
    else:
        kernels = [problem.forward_kernel(tuning.peek("conv2d_forward", problem.key, problem.forward_candidates()))]
    if not backward:
        return [k.id for k in kernels]
    if problem.unfolded:
        dx_config = tuning.peek("conv2d_unfolded_dx", problem.key, problem.unfolded_dx_candidates())
        kernels += [problem.unfolded_dx_kernel(dx_config), problem.fold_kernel()]
    else:
        transposed = problem.dx_forward()
        if transposed is not None:
            kernels += _cl_forward_kernels(transposed, device)
        elif problem.dx_channels_last:
            config = tuning.peek("conv2d_cl_dx", problem.key, problem.cl_dx_candidates())
            kernels.append(problem.cl_dx_kernel(config))
        else:
            kernels.append(problem.dx_kernel(tuning.peek("conv2d_dx", problem.key, problem.dx_candidates())))
    if problem.unfolded_dw:
        dw_config = tuning.peek("conv2d_unfolded_dw", problem.key + (bias,), problem.unfolded_dw_candidates())
        if dw_config.winograd:
            kernels += winograd.weight_gradient_kernels(dw_config, bias)
        else:
            kernels += [problem.unfold_kernel(), *([problem.grad_rows_kernel()] if problem.rows_outer_dw else []),
                        problem.pointwise_dw_kernel(dw_config, bias), problem.reduce_kernel(bias)]
    else:
        tma_dw = problem.tma_dw(device)
        if tma_dw:
            config = tuning.peek("conv2d_tma_dw", problem.key + (bias,), problem.tma_dw_candidates())
            kernels.append(problem.tma_dw_kernel(config, bias))
        elif problem.channels_last:
            config = tuning.peek("conv2d_cl_dw", problem.key + (bias,), problem.cl_dw_candidates())
            kernels.append(problem.cl_dw_kernel(config, bias))
        else:
            kernels.append(problem.dw_kernel(tuning.peek("conv2d_dw", problem.key + (bias,), problem.dw_candidates()),
                                             bias))
        kernels.append(problem.reduce_kernel(bias, problem.dw_taps(tma_dw)))
    return [k.id for k in kernels]


def precompile(x, weight, stride=1, padding=0, dilation=1, groups=1, bias=False, backward=True, full=False):
    """Launch, once each, every kernel that `conv2d` could pick for this call, the tuning candidates
    of NNKERNELS_TUNE=quick (or all, with `full`) included, on scratch outputs, timing and
    remembering nothing: Triton then has them all in its disk cache, so another process (one that
    tunes, say) loads them instead of compiling. Lets callers compile in parallel."""
    problem = Problem(x.shape, weight.shape, _pair(stride, "stride"), _pair(padding, "padding"),
                       _pair(dilation, "dilation"), groups, x.dtype, bias)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(problem.B, problem.C_OUT, problem.OH, problem.OW, dtype=x.dtype, device=x.device)
    bias_arg = torch.zeros(problem.C_OUT, dtype=x.dtype, device=x.device) if bias else y
    if problem.depthwise:  # one kernel each way, nothing to tune
        _forward(x, weight, bias_arg if bias else None, *problem.geometry_args)
        if backward:
            _dx(y, weight, problem, x.device)
            _dw_dbias(y, x, problem, bias)
        return
    pick = (lambda found: found) if full else (lambda found: found[:tuning.QUICK_CANDIDATES])
    p = problem
    if p.pointwise:
        sizes = (p.B, p.C_IN, p.C_OUT, p.OH * p.OW)
        x_in = p.pointwise_input(x)
        for config in pick(p.pointwise_candidates()):
            _launch(p.pointwise_kernel(config), x_in, weight, bias_arg, y, *sizes)
        if backward:
            dx, weight_t = p.pointwise_dx(x.device), weight.reshape(p.C_OUT, p.C_IN).t().contiguous()
            for config in pick(p.pointwise_candidates(for_dx=True)):
                _launch(p.pointwise_kernel(config, for_dx=True), y, weight_t, dx, dx, p.B, p.C_OUT, p.C_IN,
                        p.OH * p.OW)
            _dw_dbias(y, x, p, bias, pick=pick)
        return
    if p.forward_channels_last:
        copies = functools.cache(lambda: channels_last_pair(x, weight))
        for config in pick(p.cl_forward_candidates(x.device)):
            _forward_with(p, config, x, weight, bias_arg, y, copies)
    else:
        for config in pick(p.forward_candidates()):
            _launch(p.forward_kernel(config), x, weight, bias_arg, y, *p.sizes)
    if not backward:
        return
    if p.unfolded:  # the forward's output stands in for dy
        dx, weight_t = torch.empty_like(x), p.unfolded_dx_weight(weight)
        for config in pick(p.unfolded_dx_candidates()):
            _unfolded_dx(p, config, y, weight_t, dx)
        _dw_dbias(y, x, p, bias, pick=pick)
        return
    # The forward's output stands in for dy.
    y_cl = channels_last(y) if p.channels_last or p.dx_channels_last else None
    dx = torch.empty_like(x)
    transposed = p.dx_forward()
    if transposed is not None:
        copies = functools.cache(lambda: (y_cl, p.dx_forward_weight(weight)))
        for config in pick(transposed.cl_forward_candidates(x.device)):
            _forward_with(transposed, config, y, weight, dx, dx, copies)
    elif p.dx_channels_last:
        w_t = p.cl_dx_weight(weight)
        for config in pick(p.cl_dx_candidates()):
            _launch(p.cl_dx_kernel(config), y_cl, w_t, dx, *p.sizes)
    else:
        for config in pick(p.dx_candidates()):
            _launch(p.dx_kernel(config), y, weight, dx, *p.sizes)
    _dw_dbias(y, x, p, bias, y_cl, pick=pick)


# ---- the work ----

def _cl_forward(problem, config, x_cl, w_cl, bias_arg, y):
    """The channels-last forward with `config`; split over K (config.split > 1) into fp32 partials,
    then their ordered sum into y."""
    kernel = problem.cl_forward_kernel(config)
    if config.split == 1:
        _launch(kernel, x_cl, w_cl, bias_arg, y, y.new_empty(0, dtype=torch.float32), *problem.sizes)
        return
    partial = torch.empty(config.split, y.numel(), dtype=torch.float32, device=y.device)
    _launch(kernel, x_cl, w_cl, bias_arg, y, partial, *problem.sizes)
    _launch(problem.split_sum_kernel(y.numel()), partial, y, y, config.split, y.numel(), problem.C_OUT)


def _forward_with(problem, config, x, weight, bias_arg, y, channels_last_inputs):
    """The forward of `problem` with `config`: Winograd's (`config.winograd`; `weight` as the caller has it,
    transposed by the kernels for `dx_forward`'s problems), else the channels-last kernels' on
    `channels_last_inputs()`'s (x_cl, w_cl)."""
    if config.winograd:
        winograd.forward(x, weight, bias_arg if problem.has_bias else None, y, config, transposed=problem.flip_taps)
    else:
        _cl_forward(problem, config, *channels_last_inputs(), bias_arg, y)


def _unfolded_dx(problem, config, grad_y, weight_t, dx):
    """dx = fold(w^T @ dy[b]), the columns in fp32 (`Conv2dPointwiseFp32Out` with `config`), a slice of the
    batch at a time."""
    kernel = problem.unfolded_dx_kernel(config)
    for first, end in problem.unfold_slices(4):
        columns = torch.empty(end - first, problem.unfolded_rows, problem.OH, problem.OW, dtype=torch.float32,
                              device=dx.device)
        _launch(kernel, grad_y[first:end], weight_t, columns, end - first, problem.C_OUT, problem.unfolded_rows,
                problem.OH * problem.OW)
        fold_into(columns, dx[first:end], problem.geometry)


def _forward(x, weight, bias, stride, padding, dilation, groups):
    problem = Problem(x.shape, weight.shape, stride, padding, dilation, groups, x.dtype, bias is not None)
    y = torch.empty(problem.B, problem.C_OUT, problem.OH, problem.OW, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else y  # not read when HAS_BIAS is False
    if problem.depthwise:
        _launch(problem.depthwise_forward_kernel(), x, weight, bias_arg, y, *problem.launch_sizes)
        return y
    if problem.pointwise:
        x_in = problem.pointwise_input(x)

        def run_pointwise(config):
            _launch(problem.pointwise_kernel(config), x_in, weight, bias_arg, y, problem.B, problem.C_IN,
                    problem.C_OUT, problem.OH * problem.OW)

        run_pointwise(tuning.choose("conv2d_pointwise", problem.key, problem.pointwise_candidates, run_pointwise))
        return y

    if problem.forward_channels_last:
        # Made in each run: a timed direct config pays for its copies, as Winograd pays for its transforms.
        def run_cl(config):
            _forward_with(problem, config, x, weight, bias_arg, y, lambda: channels_last_pair(x, weight))

        run_cl(tuning.choose("conv2d_cl_forward", problem.key, lambda: problem.cl_forward_candidates(x.device), run_cl))
        return y

    def run(config):
        _launch(problem.forward_kernel(config), x, weight, bias_arg, y, *problem.sizes)

    run(tuning.choose("conv2d_forward", problem.key, problem.forward_candidates, run))
    return y


def _dx(grad_y, weight, problem, device, grad_y_cl=None):
    shape = (problem.B, problem.C_IN, problem.H, problem.W)
    if problem.unfolded:
        dx, weight_t = torch.empty(shape, dtype=problem.dtype, device=device), problem.unfolded_dx_weight(weight)

        def run_unfolded(config):
            _unfolded_dx(problem, config, grad_y, weight_t, dx)

        run_unfolded(tuning.choose("conv2d_unfolded_dx", problem.key, problem.unfolded_dx_candidates, run_unfolded))
        return dx
    transposed = problem.dx_forward()
    if transposed is not None:
        dx = torch.empty(shape, dtype=problem.dtype, device=device)

        def copies():  # grad_y_cl is None where Winograd may run dx (`_backward`): then made here, by direct runs
            return (grad_y_cl if grad_y_cl is not None else channels_last(grad_y)), problem.dx_forward_weight(weight)

        def run_forward(config):
            _forward_with(transposed, config, grad_y, weight, dx, dx, copies)  # no bias: dx stands in, unread

        run_forward(tuning.choose("conv2d_cl_forward", transposed.key,
                                  lambda: transposed.cl_forward_candidates(device), run_forward))
        return dx
    if problem.dx_channels_last:
        w_t = problem.cl_dx_weight(weight)
        nhwc = (problem.B, problem.H, problem.W, problem.C_IN)
        written = torch.empty(nhwc if problem.dx_nhwc else shape, dtype=problem.dtype, device=device)

        def run_cl(config):
            _launch(problem.cl_dx_kernel(config), grad_y_cl, w_t, written, *problem.sizes)

        run_cl(tuning.choose("conv2d_cl_dx", problem.key, problem.cl_dx_candidates, run_cl))
        return channels_first(written) if problem.dx_nhwc else written
    dx = torch.empty(shape, dtype=problem.dtype, device=device)
    if problem.depthwise:
        _launch(problem.depthwise_dx_kernel(), grad_y, weight, dx, *problem.launch_sizes)
        return dx
    if problem.pointwise:
        weight_t = weight.reshape(problem.C_OUT, problem.C_IN).t().contiguous()  # [C_IN, C_OUT]: tiny
        written = problem.pointwise_dx(device) if problem.subsampled else dx

        def run_pointwise(config):
            _launch(problem.pointwise_kernel(config, for_dx=True), grad_y, weight_t, written, written, problem.B,
                    problem.C_OUT, problem.C_IN, problem.OH * problem.OW)

        run_pointwise(tuning.choose("conv2d_pointwise_dx", problem.key,
                                    lambda: problem.pointwise_candidates(for_dx=True), run_pointwise))
        return subsample_backward(written, shape, problem.stride) if problem.subsampled else dx

    def run(config):
        _launch(problem.dx_kernel(config), grad_y, weight, dx, *problem.sizes)

    run(tuning.choose("conv2d_dx", problem.key, problem.dx_candidates, run))
    return dx


def _dw_dbias(grad_y, x, problem, with_bias, grad_y_cl=None, pick=None):
    """dw and dbias (empty unless `with_bias`): split partial sums, then their ordered sum. The
    split kernel's config is tuned; with `pick` (precompile's), every picked candidate runs instead."""
    dw = torch.empty(problem.C_OUT, problem.cin_per_group, problem.KH, problem.KW, dtype=problem.dtype,
                     device=x.device)
    dbias = torch.empty(problem.C_OUT if with_bias else 0, dtype=problem.dtype, device=x.device)
    row = dw_partial_size(problem.C_OUT, problem.cin_per_group, problem.KH, problem.KW, with_bias)
    if problem.depthwise:  # one tile, from a heuristic: nothing to tune
        partial = torch.empty(problem.depthwise_dw_split(), row, dtype=torch.float32, device=x.device)
        _launch(problem.depthwise_dw_kernel(with_bias), grad_y, x, partial, *problem.launch_sizes, len(partial))
        _launch(problem.reduce_kernel(with_bias), partial, dw, dbias if with_bias else dw, len(partial), dw.numel(),
                problem.C_OUT)
        return dw, dbias
    if problem.unfolded_dw:
        kind, candidates = "conv2d_unfolded_dw", problem.unfolded_dw_candidates
        slices, reduce = problem.unfold_slices(x.element_size()), problem.reduce_kernel(with_bias)
        out_size, plane, rows_outer = (problem.OH, problem.OW), problem.OH * problem.OW, problem.rows_outer_dw

        def run(config):  # each slice of the batch writes its own `split` partial rows
            if config.winograd:
                winograd.weight_gradient(grad_y, x, dw, dbias if with_bias else None, config)
                return
            partial = torch.empty(len(slices) * config.split, row, dtype=torch.float32, device=x.device)
            kernel = problem.pointwise_dw_kernel(config, with_bias)
            for index, (first, end) in enumerate(slices):
                columns = unfold(x[first:end], problem.geometry, out_size, rows_outer)
                if rows_outer:  # the slice's pixels as one image's
                    grad_rows, images, pixels = unfold(grad_y[first:end], ROWS_OUTER_COPY, out_size, True), 1, (
                        end - first) * plane
                else:
                    grad_rows, images, pixels = grad_y[first:end], end - first, plane
                _launch(kernel, grad_rows, columns, partial[index * config.split:(index + 1) * config.split],
                        images, problem.unfolded_rows, problem.C_OUT, pixels, config.split)
            _launch(reduce, partial, dw, dbias if with_bias else dw, len(partial), dw.numel(), problem.C_OUT)
    else:
        kind, candidates, make_kernel, inputs, sizes, taps = _split_dw_plan(problem, grad_y, grad_y_cl, x)
        reduce = problem.reduce_kernel(with_bias, taps)

        def run(config):
            partial = torch.empty(config.split, row, dtype=torch.float32, device=x.device)
            _launch(make_kernel(config, with_bias), *inputs, partial, *sizes, config.split)
            _launch(reduce, partial, dw, dbias if with_bias else dw, config.split, dw.numel(), problem.C_OUT)

    if pick is None:
        run(tuning.choose(kind, problem.key + (with_bias,), candidates, run))
    else:
        for config in pick(candidates()):
            run(config)
    return dw, dbias


def _split_dw_plan(problem, grad_y, grad_y_cl, x):
    """(tuning kind, candidates (a function listing them), kernel maker, inputs, sizes, the reduce's TAPS)
    of the tuned dw kernels: the 1x1 product's, the TMA boxes' (tap-major partials), the channels-last or
    NCHW implicit GEMM's."""
    if problem.pointwise:
        sizes = (problem.B, problem.C_IN, problem.C_OUT, problem.OH * problem.OW)
        return ("conv2d_pointwise_dw", problem.pointwise_dw_candidates, problem.pointwise_dw_kernel,
                (grad_y, problem.pointwise_input(x)), sizes, 1)
    if problem.tma_dw(x.device):
        return ("conv2d_tma_dw", problem.tma_dw_candidates, problem.tma_dw_kernel, (grad_y_cl, channels_last(x)),
                problem.sizes, problem.dw_taps(True))
    if problem.channels_last:
        return ("conv2d_cl_dw", problem.cl_dw_candidates, problem.cl_dw_kernel, (grad_y_cl, channels_last(x)),
                problem.sizes, 1)
    return "conv2d_dw", problem.dw_candidates, problem.dw_kernel, (grad_y, x), problem.launch_sizes, 1

def _batch_chunks(x, y_shape):
    """Slices of the batch, [first, end), each small enough for the kernels' int32 pixel index over
    (b, oh, ow) and (b, ih, iw); a single slice unless the batch holds 2**31 pixels or more."""
    pixels_per_image = max(x.shape[2] * x.shape[3], y_shape[2] * y_shape[3])
    step = max(1, (PIXEL_INDEX_LIMIT - 1) // pixels_per_image)
    return [(first, min(first + step, x.shape[0])) for first in range(0, x.shape[0], step)]


def _output_shape(x, weight, stride, padding, dilation):
    oh = output_size(x.shape[2], weight.shape[2], stride[0], padding[0], dilation[0])
    ow = output_size(x.shape[3], weight.shape[3], stride[1], padding[1], dilation[1])
    return (x.shape[0], weight.shape[0], oh, ow)


@torch.library.custom_op("nnkernels::conv2d", mutates_args=())
def conv2d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> Tensor:
    """The forward custom op (see `conv2d`, which also handles 3-D input and string padding)."""
    _check(x, weight, bias, stride, padding, dilation, groups)
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    args = (tuple(stride), tuple(padding), tuple(dilation), groups)
    shape = _output_shape(x, weight, stride, padding, dilation)
    if shape[0] == 0:
        return x.new_empty(shape)
    chunks = _batch_chunks(x, shape)
    if len(chunks) > 1:
        return torch.cat([_forward(x[first:end], weight, bias, *args) for first, end in chunks])
    return _forward(x, weight, bias, *args)


@conv2d_op.register_fake
def _conv2d_fake(x, weight, bias, stride, padding, dilation, groups):
    return x.new_empty(_output_shape(x, weight, stride, padding, dilation))


@torch.library.custom_op("nnkernels::conv2d_backward", mutates_args=())
def conv2d_backward_op(grad_y: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                       dilation: list[int], groups: int, need_dx: bool, need_dw: bool,
                       need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias) of `nnkernels::conv2d`; a gradient not asked for comes back as an empty tensor."""
    _check(x, weight, None, stride, padding, dilation, groups)
    x, weight, grad_y = x.contiguous(), weight.contiguous(), grad_y.contiguous()
    if x.shape[0] == 0:
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
                torch.zeros_like(weight) if need_dw else x.new_empty(0),
                weight.new_zeros(weight.shape[0]) if need_dbias else x.new_empty(0))
    chunks = _batch_chunks(x, grad_y.shape)
    if len(chunks) > 1:
        parts = [_backward(grad_y[first:end], x[first:end], weight, stride, padding, dilation, groups, need_dx,
                           need_dw, need_dbias) for first, end in chunks]
        dx = torch.cat([part[0] for part in parts]) if need_dx else x.new_empty(0)
        # The chunks' weight gradients add up in a fixed order, in fp32: still deterministic.
        dw, dbias = (sum(part[i].float() for part in parts).to(x.dtype) for i in (1, 2))
        return dx, dw, dbias
    return _backward(grad_y, x, weight, stride, padding, dilation, groups, need_dx, need_dw, need_dbias)


def _backward(grad_y, x, weight, stride, padding, dilation, groups, need_dx, need_dw, need_dbias):
    problem = Problem(x.shape, weight.shape, tuple(stride), tuple(padding), tuple(dilation), groups, x.dtype,
                       need_dbias)
    expected = (problem.B, problem.C_OUT, problem.OH, problem.OW)
    if tuple(grad_y.shape) != expected or grad_y.dtype != x.dtype or grad_y.device != x.device:
        raise ValueError(f"grad_y: expected {x.dtype} of shape {expected} on {x.device}, got {grad_y.dtype} "
                         f"{tuple(grad_y.shape)} on {grad_y.device}")
    needs_cl = (need_dx and problem.dx_channels_last and not problem.winograd) or (
        (need_dw or need_dbias) and problem.channels_last and not problem.pointwise and not problem.unfolded_dw)
    grad_y_cl = channels_last(grad_y) if needs_cl else None

    def dx_work():
        return _dx(grad_y, weight, problem, x.device, grad_y_cl)

    def dw_work():
        return _dw_dbias(grad_y, x, problem, need_dbias, grad_y_cl)

    if need_dx and (need_dw or need_dbias):
        dx, (dw, dbias) = side_by_side(x.device, dx_work, dw_work)
    elif need_dx:
        dx, dw, dbias = dx_work(), x.new_empty(0), x.new_empty(0)
    else:
        dx, (dw, dbias) = x.new_empty(0), dw_work()
    return dx, dw if need_dw else x.new_empty(0), dbias


@conv2d_backward_op.register_fake
def _conv2d_backward_fake(grad_y, x, weight, stride, padding, dilation, groups, need_dx, need_dw, need_dbias):
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else x.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_dbias else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.conv_args = (stride, padding, dilation, groups)
    ctx.has_bias = bias is not None


def _conv2d_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
    need_dbias = need_dbias and ctx.has_bias
    dx, dw, dbias = torch.ops.nnkernels.conv2d_backward(grad_y, x, weight, *ctx.conv_args, need_dx, need_dw,
                                                        need_dbias)
    return (dx if need_dx else None, dw if need_dw else None, dbias if need_dbias else None, None, None, None, None)


conv2d_op.register_autograd(_conv2d_backward, setup_context=_setup_context)


def _register_autocast(device_type):
    """Under autocast, cast floating inputs to the *active* autocast dtype (as torch's conv does), then
    run the op with autocast off. `torch.library.register_autocast` fixes one dtype at registration,
    so the rule is registered by hand on the Autocast<device> key, the way it registers its own."""
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))

    def cast(tensor, dtype):
        eligible = tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float64
        return tensor.to(dtype) if eligible else tensor

    def autocast_conv2d(keyset, x, weight, bias, stride, padding, dilation, groups):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return conv2d_op(cast(x, dtype), cast(weight, dtype), cast(bias, dtype), stride, padding, dilation,
                             groups)

    _AUTOCAST_LIBRARY.impl("conv2d", autocast_conv2d, key_name, with_keyset=True)


_AUTOCAST_LIBRARY = torch.library.Library("nnkernels", "IMPL")
for _device_type in ("cuda", "cpu"):
    _register_autocast(_device_type)
