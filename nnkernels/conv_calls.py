"""The convolution calls a model makes: `conv_shapes(model, inputs)` runs one forward pass on the meta device
(no GPU memory, no weights) with hooks on every `torch.nn.Conv2d` and `ConvTranspose2d` (nnkernels' included) and
counts each call's `ConvShape`: input and weight shapes and the layer's options, with string padding and non-zero
padding modes resolved to what the convolution itself sees; a transposed convolution counts as the convolution
whose input gradient it is (from its output to its input, no bias), which is what it runs. `nnkernels bench model-convs` times them; `warmup(jobs=N)` compiles
their kernels in parallel first."""
from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ConvShape:
    """One convolution call as a layer makes it: input and weight shapes, the layer's options, and whether its
    output is channels-last (as torch gives it: x or the weight channels-last)."""

    x_shape: tuple
    w_shape: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    bias: bool
    channels_last: bool = False

    @property
    def y_shape(self) -> tuple:
        (batch, _, height, width), (c_out, _, kh, kw) = self.x_shape, self.w_shape
        sizes = [(size + 2 * pad - dil * (k - 1) - 1) // step + 1 for size, k, step, pad, dil in
                 zip((height, width), (kh, kw), self.stride, self.padding, self.dilation)]
        return (batch, c_out, *sizes)

    @property
    def name(self) -> str:
        (_, c_in, height, width), (c_out, _, kh, kw) = self.x_shape, self.w_shape
        options = "".join(f" {letter}{values[0] if values[0] == values[1] else 'x'.join(map(str, values))}"
                          for letter, values, plain in (("s", self.stride, 1), ("p", self.padding, 0),
                                                        ("d", self.dilation, 1)) if values != (plain, plain))
        return (f"{kh}x{kw} {c_in}->{c_out} {height}x{width}{options}"
                + (f" g{self.groups}" if self.groups > 1 else "") + (" +bias" if self.bias else "")
                + (" channels-last" if self.channels_last else ""))

    def flops(self) -> int:
        _, c_out, oh, ow = self.y_shape
        return 2 * self.x_shape[0] * c_out * oh * ow * self.w_shape[1] * self.w_shape[2] * self.w_shape[3]


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
    from .functional.conv import channels_last_output

    found = collections.Counter()

    def record(module, args, output):
        x_shape, padding = _padding(module, tuple(args[0].shape))
        found[ConvShape(x_shape, tuple(module.weight.shape), tuple(module.stride), padding, tuple(module.dilation),
                        module.groups, module.bias is not None, channels_last_output(args[0], module.weight))] += 1

    def record_transposed(module, args, output):
        found[ConvShape(tuple(output.shape), tuple(module.weight.shape), tuple(module.stride), tuple(module.padding),
                        tuple(module.dilation), module.groups, False,
                        channels_last_output(args[0], module.weight))] += 1

    if isinstance(inputs, (tuple, list, torch.Size)) and all(isinstance(size, int) for size in inputs):
        arguments = (torch.empty(tuple(inputs), device="meta"),)
    else:
        arguments = tuple(_on_meta(arg) for arg in (inputs if isinstance(inputs, tuple) else (inputs,)))
    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    hooks += [m.register_forward_hook(record_transposed) for m in model.modules()
              if isinstance(m, torch.nn.ConvTranspose2d)]
    try:
        model.to("meta").train(training)
        with torch.no_grad():
            model(*arguments)
    finally:
        for hook in hooks:
            hook.remove()
    return found
