"""`unfold(x, geometry, out_size)`: a convolution's input taps as planes (im2col, torch's `F.unfold` with
[B, C*KH*KW, OH, OW] for shape), by `Unfold2d`; `fold_into(columns, x, geometry)`: its adjoint, summed
into x, by `Fold2d`. `geometry` is (KH, KW, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W). Each
launch is logged at DEBUG level on the "nnkernels" logger, like the ops'.
"""
import functools
import logging

import torch

from ..ops.conv2d.unfold import Fold2d, Unfold2d, fold_tiles, unfold_tiles

_log = logging.getLogger("nnkernels")


@functools.lru_cache(maxsize=None)
def unfold_kernel(geometry, out_size, dtype, rows_outer=False):
    return Unfold2d(*geometry, rows_outer, *unfold_tiles(*out_size), dtype=dtype)


@functools.lru_cache(maxsize=None)
def fold_kernel(geometry, height, width, dtype):
    return Fold2d(*geometry, *fold_tiles(height, width, geometry[2:4]), dtype=dtype)


def _launch(kernel, *args):
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("unfold launches %s", kernel.id)
    kernel.launch(*args)


def unfold(x, geometry, out_size, rows_outer=False):
    """The [B, C*KH*KW, OH, OW] columns of a contiguous NCHW x: columns[b, (c, kh, kw), oh, ow] =
    x[b, c, oh*STRIDE_H - PAD_H + kh*DIL_H, ow*STRIDE_W - PAD_W + kw*DIL_W], 0 in the padding;
    with `rows_outer`, the same columns as [C*KH*KW, B, OH, OW]."""
    batch, channels, height, width = x.shape
    rows = channels * geometry[0] * geometry[1]
    shape = (rows, batch, *out_size) if rows_outer else (batch, rows, *out_size)
    columns = torch.empty(shape, dtype=x.dtype, device=x.device)
    if columns.numel():
        _launch(unfold_kernel(tuple(geometry), tuple(out_size), x.dtype, rows_outer), x, columns,
                batch * channels, channels, height, width, *out_size)
    return columns


def fold_into(columns, x, geometry):
    """Write into the contiguous NCHW x the adjoint of `unfold` applied to fp32 `columns` ([B, C*KH*KW, OH, OW]):
    each pixel the sum, in fp32 rounded once, of the columns of the taps that read it."""
    batch, channels, height, width = x.shape
    if x.numel():
        _launch(fold_kernel(tuple(geometry), height, width, x.dtype), columns, x, batch * channels, height, width,
                *columns.shape[2:])
