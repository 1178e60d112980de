"""The layer calls a model makes, found by one forward pass on the meta device (no GPU memory, no weights) with
hooks on its layers: `conv_shapes(model, inputs)` counts each convolution call's `ConvShape` (every
`torch.nn.Conv2d` and `ConvTranspose2d`, nnkernels' included): input and weight shapes and the layer's options,
with string padding and non-zero padding modes resolved to what the convolution itself sees; a transposed
convolution counts as the convolution whose input gradient it is (from its output to its input, no bias), which
is what it runs. `layer_shapes(model, inputs)` also counts the calls of nnkernels' batch-norm and average-pooling
layers (`BatchNormShape`, `AvgPoolShape`), in the order of the forward. `nnkernels bench model-convs` times the
convolutions; `warmup` and compiling ahead compile every layer's kernels in parallel processes."""
from __future__ import annotations

import collections
import copy
import itertools

import torch

from .layer_shapes import AvgPoolShape, BatchNormShape, ConvShape


def _padding(module, x_shape) -> tuple[tuple, tuple]:
    """(the input shape the convolution sees, its explicit padding) for a layer's padding and padding_mode."""
    padding = module.padding
    if isinstance(padding, str):  # 'valid' or 'same' (stride 1): torch pads the right and bottom one more
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)] if padding == "same" else [0, 0]
        extra = [t % 2 for t in totals]
        x_shape = (*x_shape[:2], x_shape[2] + extra[0], x_shape[3] + extra[1])
        padding = tuple(t // 2 for t in totals)
    if module.padding_mode != "zeros":  # F.pad first, then a convolution without padding
        return (*x_shape[:2], x_shape[2] + 2 * padding[0], x_shape[3] + 2 * padding[1]), (0, 0)
    return x_shape, tuple(padding)


def _on_meta(arg):
    return torch.empty_like(arg, device="meta") if isinstance(arg, torch.Tensor) else arg


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers are meta tensors of the same shapes, dtypes and strides,
    made without copying their data (a GPU model's copy takes no GPU memory)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def conv_shapes(model: torch.nn.Module, inputs, training: bool = False) -> collections.Counter:
    """{ConvShape: how many times the forward of `model` calls it}, from one forward pass on the meta device (the
    model is moved there), in training mode or not. `inputs`: an input's shape, or the positional arguments of
    the forward (tensors stand for meta tensors of their shapes and dtypes)."""
    return _meta_pass(model, inputs, training, layers=False)


def layer_shapes(model: torch.nn.Module, inputs, training: bool = False) -> collections.Counter:
    """`conv_shapes` with the calls of nnkernels' batch-norm and average-pooling layers too, all in the order the
    forward first makes them."""
    return _meta_pass(model, inputs, training, layers=True)


def _channels_last(x) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _meta_pass(model, inputs, training, layers):
    from . import nn
    from .functional.conv import channels_last_output
    from .functional.pooling import window_options

    found = collections.Counter()

    def record(module, args, output):
        x_shape, padding = _padding(module, tuple(args[0].shape))
        found[ConvShape(x_shape, tuple(module.weight.shape), tuple(module.stride), padding, tuple(module.dilation),
                        module.groups, module.bias is not None, channels_last_output(args[0], module.weight))] += 1

    def record_transposed(module, args, output):
        found[ConvShape(tuple(output.shape), tuple(module.weight.shape), tuple(module.stride), tuple(module.padding),
                        tuple(module.dilation), module.groups, False,
                        channels_last_output(args[0], module.weight))] += 1

    def record_batch_norm(module, args, output):
        # `nn.BatchNorm2d.forward`'s choice of statistics, read without counting a step
        training = module.training or (module.running_mean is None and module.running_var is None)
        tracked = (not module.training or module.track_running_stats) and module.running_mean is not None
        found[BatchNormShape(tuple(args[0].shape), _channels_last(args[0]), training, training and tracked)] += 1

    def record_pooling(module, args, output):
        kernel, stride, padding = window_options(module.kernel_size, module.stride, module.padding)
        found[AvgPoolShape(tuple(args[0].shape), kernel, stride, padding, module.ceil_mode,
                           module.count_include_pad, module.divisor_override or 0, _channels_last(args[0]))] += 1

    if isinstance(inputs, (tuple, list, torch.Size)) and all(isinstance(size, int) for size in inputs):
        arguments = (torch.empty(tuple(inputs), device="meta"),)
    else:
        arguments = tuple(_on_meta(arg) for arg in (inputs if isinstance(inputs, tuple) else (inputs,)))
    recorders = [(torch.nn.Conv2d, record), (torch.nn.ConvTranspose2d, record_transposed)]
    if layers:
        recorders += [(nn.BatchNorm2d, record_batch_norm), (nn.AvgPool2d, record_pooling)]
    hooks = [m.register_forward_hook(recorder) for m in model.modules() for kind, recorder in recorders
             if isinstance(m, kind)]
    try:
        model.to("meta").train(training)
        with torch.no_grad():
            model(*arguments)
    finally:
        for hook in hooks:
            hook.remove()
    return found
