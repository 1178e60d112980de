"""The shape of one layer call, as the meta pass (`layer_calls`) finds it and compiling ahead compiles it: a
convolution's (`ConvShape`), a batch norm's (`BatchNormShape`), an average pooling's (`AvgPoolShape`). A plan's
first run names its job (`compile_jobs`) by the same shape."""
from __future__ import annotations

import math
from dataclasses import dataclass


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

    def elements(self) -> int:
        """Elements of the tensors one call reads and writes: x, the weight and y."""
        return sum(math.prod(shape) for shape in (self.x_shape, self.w_shape, self.y_shape))


@dataclass(frozen=True)
class BatchNormShape:
    """One call of nnkernels' batch norm as a layer makes it: x's shape and layout, whether it normalises by the
    batch's statistics (`training`) and whether it updates running statistics there (`running`)."""

    x_shape: tuple
    channels_last: bool
    training: bool
    running: bool

    @property
    def name(self) -> str:
        mode = ("training" + (" with running statistics" if self.running else "")) if self.training else "evaluation"
        return (f"batch norm {'x'.join(map(str, self.x_shape))} {mode}"
                + (" channels-last" if self.channels_last else ""))

    def elements(self) -> int:
        """Elements of the tensors one call reads and writes: x and y."""
        return 2 * math.prod(self.x_shape)


@dataclass(frozen=True)
class AvgPoolShape:
    """One call of nnkernels' average pooling as a layer makes it: x's shape and layout and the layer's options, as
    `nnkernels.functional.avg_pool2d` takes them (divisor 0: none)."""

    x_shape: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    ceil_mode: bool
    count_include_pad: bool
    divisor: int
    channels_last: bool

    @property
    def name(self) -> str:
        return (f"average pooling {'x'.join(map(str, self.kernel))} s{'x'.join(map(str, self.stride))} of "
                f"{'x'.join(map(str, self.x_shape))}" + (" channels-last" if self.channels_last else ""))

    def elements(self) -> int:
        """Elements of the tensors one call reads and writes, at most: x twice (y is no larger)."""
        return 2 * math.prod(self.x_shape)
