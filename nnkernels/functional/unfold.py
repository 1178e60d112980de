"""A convolution's input taps as planes (im2col) and their adjoint, as factories a plan calls once per signature.
`geometry` is (KH, KW, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W).

- `unfold_copy(x_shape, geometry, out_size, dtype, device, rows_outer)`: x -> columns, [B, C*KH*KW, OH, OW] (torch's
  `F.unfold` with that shape), or [C*KH*KW, B, OH, OW] with `rows_outer` (`Unfold2d`);
- `folder(x_shape, geometry, out_size, dtype)`: (fp32 columns, x) -> x written with the adjoint of `unfold` applied
  to the columns (`Fold2d`).
`unfold(x, ...)` and `fold_into(columns, x, geometry)` do the same once.
"""
from __future__ import annotations

import functools

from ..launcher import Launcher
from .common import allocator
from ..ops.conv2d.unfold import Fold2d, Unfold2d, fold_tiles, unfold_tiles


@functools.lru_cache(maxsize=None)
def unfold_kernel(geometry, out_size, dtype, rows_outer=False):
    return Unfold2d(*geometry, rows_outer, *unfold_tiles(*out_size), dtype=dtype)


@functools.lru_cache(maxsize=None)
def fold_kernel(geometry, height, width, dtype):
    return Fold2d(*geometry, *fold_tiles(height, width, geometry[2:4]), dtype=dtype)


def unfold_copy(x_shape, geometry, out_size, dtype, device, rows_outer=False):
    """x [B, C, H, W] -> its columns: columns[b, (c, kh, kw), oh, ow] = x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H,
    ow*STRIDE_W - PAD_W + kw*DIL_W], 0 in the padding ([C*KH*KW, B, OH, OW] with `rows_outer`)."""
    batch, channels, height, width = x_shape
    rows = channels * geometry[0] * geometry[1]
    shape = (rows, batch, *out_size) if rows_outer else (batch, rows, *out_size)
    new = allocator(dtype, device)
    if not rows * batch * out_size[0] * out_size[1]:
        return lambda x: new(*shape)
    launch = Launcher(unfold_kernel(tuple(geometry), tuple(out_size), dtype, rows_outer))
    sizes = (batch * channels, channels, height, width, *out_size)

    def copy(x):
        columns = new(*shape)
        launch(x, columns, *sizes)
        return columns

    return copy


def folder(x_shape, geometry, out_size, dtype):
    """(fp32 columns [B, C*KH*KW, OH, OW], x) -> x, each pixel written with the sum, in fp32 rounded once, of the
    columns of the taps that read it."""
    batch, channels, height, width = x_shape
    if not batch * channels * height * width:
        return lambda columns, x: x
    launch = Launcher(fold_kernel(tuple(geometry), height, width, dtype))
    sizes = (batch * channels, height, width, *out_size)

    def fold(columns, x):
        launch(columns, x, *sizes)
        return x

    return fold


def unfold(x, geometry, out_size, rows_outer=False):
    """The columns of a contiguous NCHW x (see `unfold_copy`)."""
    return unfold_copy(tuple(x.shape), geometry, out_size, x.dtype, x.device, rows_outer)(x)


def fold_into(columns, x, geometry):
    """Write into the contiguous NCHW x the adjoint of `unfold` applied to fp32 `columns`."""
    return folder(tuple(x.shape), geometry, tuple(columns.shape[2:]), x.dtype)(columns, x)
