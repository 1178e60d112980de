"""Winograd F(2x2, 3x3) passes of a 3x3, stride-1, padding-1, one-group convolution (`ops/conv2d/winograd_transforms.py`).

`conv2d` offers them to tuning beside its direct kernels for fp32 with TF32 off, where PyTorch's cuDNN runs
Winograd too (see `conv2d_plan.Problem.winograd`): the forward, dx as the forward of dy with the flipped, transposed
filters, and dw. Each pass is four or five launches through fp32 matrices four times the size of the
activations they come from ([16, T, C] for T = B*cdiv(H, 2)*cdiv(W, 2) tiles), freed after the pass.

Transforms add and subtract inputs, so where an input holds an Inf, some outputs PyTorch gives as +-Inf come
out NaN (the same elements are non-finite either way). `NNKERNELS_WINOGRAD=off` keeps the direct kernels for
callers who need PyTorch's exact Inf values.
"""
import functools
import logging
import os

import torch

from ..kernel import INTERPRETED
from ..ops.conv2d.winograd_transforms import (
    POINTS,
    Conv2dWinogradDy,
    Conv2dWinogradInput,
    Conv2dWinogradOutput,
    Conv2dWinogradWeight,
    tiles_of,
)
from ..ops.conv2d.winograd_products import Conv2dWinogradDwFinish, Conv2dWinogradProducts, products_row_size

# (BLOCK_T, BLOCK_C) of the transforms, the fastest of four tiles on the H200 (B32 C128 28x28, fp32,
# nineteenth session): input to [16, T, C] (32, 32) 24.3 µs, to [16, C, T] (128, 8) 25.9, dy (128, 8) 21.7,
# output (64, 16) 25.1. The interpreter takes large tiles: few programs.
TILES = {"input": (32, 32), "input_c_major": (128, 8), "dy": (128, 8), "output": (64, 16)}
INTERPRETED_TILES = {"input": (64, 64), "input_c_major": (64, 64), "dy": (64, 64), "output": (64, 64)}
PAIR_BLOCK = 256  # (c_out, c_in) filters per program of the weight transform and of the dw finish

_log = logging.getLogger("nnkernels")


@functools.lru_cache(maxsize=None)
def _kernel(cls, constants, num_warps=None, num_stages=None):
    return cls(*constants, dtype=torch.float32, num_warps=num_warps, num_stages=num_stages)


def _launch(kernel, *args):
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("conv2d launches %s", kernel.id)
    kernel.launch(*args)


def _tiles(name):
    return (INTERPRETED_TILES if INTERPRETED else TILES)[name]


def _products(config, has_bias):
    return _kernel(Conv2dWinogradProducts, (has_bias, False, config.block_m, config.block_n, config.block_k),
                   config.num_warps, config.num_stages)


def forward_kernels(config, has_bias, transposed):
    """The kernels of `forward` with `config`, in launch order."""
    return [_kernel(Conv2dWinogradWeight, (transposed, PAIR_BLOCK)),
            _kernel(Conv2dWinogradInput, (True, *_tiles("input"))), _products(config, False),
            _kernel(Conv2dWinogradOutput, (has_bias, *_tiles("output")))]


def weight_gradient_kernels(config, has_bias):
    """The kernels of `weight_gradient` with `config`, in launch order."""
    return [_kernel(Conv2dWinogradInput, (False, *_tiles("input_c_major"))), _kernel(Conv2dWinogradDy, _tiles("dy")),
            _products(config, has_bias), _kernel(Conv2dWinogradDwFinish, (has_bias, PAIR_BLOCK))]


def forward(x, weight, bias, y, config, transposed=False):
    """y = conv2d(x, weight, bias, padding=1) for fp32 x [B, C, H, W] and weight [C_OUT, C, 3, 3]; with
    `transposed`, weight is [C, C_OUT, 3, 3] and y = conv2d(x, w', padding=1), w'[o, i] = weight[i, o]
    flipped in both axes: dx of a convolution with weight, x standing for dy. y [B, C_OUT, H, W] is written."""
    weight_kernel, input_kernel, products, output_kernel = forward_kernels(config, bias is not None, transposed)
    batch, channels, height, width = x.shape
    rows = weight.shape[1] if transposed else weight.shape[0]
    tiles = tiles_of(batch, height, width)
    v = torch.empty(POINTS, rows, channels, dtype=torch.float32, device=x.device)
    _launch(weight_kernel, weight, v, weight.shape[0], weight.shape[1])
    u = torch.empty(POINTS, tiles, channels, dtype=torch.float32, device=x.device)
    _launch(input_kernel, x, u, batch, channels, height, width)
    m = torch.empty(POINTS, rows, tiles, dtype=torch.float32, device=x.device)
    _launch(products, v, u, m, rows, tiles, channels, 1)
    _launch(output_kernel, m, y if bias is None else bias, y, batch, rows, height, width)


def weight_gradient(grad_y, x, dw, dbias, config):
    """dw (and dbias, unless None) of y = conv2d(x, w, padding=1), fp32, 3x3: the products split over the
    tiles into `config.split` fp32 partial rows, then their ordered sum."""
    input_kernel, dy_kernel, products, finish = weight_gradient_kernels(config, dbias is not None)
    batch, c_in, height, width = x.shape
    c_out = grad_y.shape[1]
    tiles = tiles_of(batch, height, width)
    u = torch.empty(POINTS, c_in, tiles, dtype=torch.float32, device=x.device)
    _launch(input_kernel, x, u, batch, c_in, height, width)
    d = torch.empty(POINTS, c_out, tiles, dtype=torch.float32, device=x.device)
    _launch(dy_kernel, grad_y, d, batch, c_out, height, width)
    partial = torch.empty(config.split, products_row_size(c_out, c_in, dbias is not None), dtype=torch.float32,
                          device=x.device)
    _launch(products, d, u, partial, c_out, c_in, tiles, config.split)
    _launch(finish, partial, dw, dw if dbias is None else dbias, config.split, c_out, c_in)


def enabled():
    """`NNKERNELS_WINOGRAD`: "on" (the default; tuning may choose Winograd) or "off"."""
    value = os.environ.get("NNKERNELS_WINOGRAD", "on").lower()
    if value not in ("on", "off"):
        raise ValueError(f"NNKERNELS_WINOGRAD: expected on or off, got {value!r}")
    return value == "on"


def fits(batch, height, width, channels):
    """Whether the [16, T, C] matrices of `channels` channels index in int32, as the kernels do."""
    return POINTS * tiles_of(batch, height, width) * channels < 2**31
