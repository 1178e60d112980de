"""Winograd F(2x2, 3x3) for full-fp32 (TF32 off) 3x3 stride-1 pad-1 one-group convolutions, where cuDNN runs
Winograd too (`ops/conv2d/winograd_*.py`): the forward, dx as the forward of dy with the flipped, transposed
filters (a `dx_forward` problem), and dw. Each pass is four launches through fp32 matrices four times the size
of the activations ([16, T, C] for T = B*cdiv(H, 2)*cdiv(W, 2) tiles), freed after the pass. It is offered to
tuning beside the direct kernels, first on planes of at most WINOGRAD_FIRST_PIXELS.

Transforms add and subtract inputs, so where an input holds an Inf some outputs PyTorch gives as +-Inf come out
NaN (the same elements are non-finite either way); `NNKERNELS_WINOGRAD=off` keeps the direct kernels.
"""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.winograd_products import Conv2dWinogradDwFinish, Conv2dWinogradProducts, products_row_size
from ...ops.conv2d.winograd_transforms import (POINTS, Conv2dWinogradDy, Conv2dWinogradInput, Conv2dWinogradOutput,
                                               Conv2dWinogradWeight, tiles_of)
from ..common import allocator
from ..common import kernel as cached_kernel
from .base import Algorithm, GemmConfig, clamp_pow2, register
from .partials import dw_split, summed_weight_gradient

WINOGRAD_FIRST_PIXELS = 28 * 28
# (BLOCK_T, BLOCK_C) of the transforms: the fastest of four tiles on the H200; the interpreter takes large ones.
TILES = {"input": (32, 32), "input_c_major": (128, 8), "dy": (128, 8), "output": (64, 16)}
INTERPRETER_TILES = {"input": (64, 64), "input_c_major": (64, 64), "dy": (64, 64), "output": (64, 64)}
PAIR_BLOCK = 256  # (c_out, c_in) filters per program of the weight transform and of the dw finish


def winograd_candidates(rows: int, channels: int, machine) -> list[GemmConfig]:
    """Tiles of the forward's 16 products (`Conv2dWinogradProducts`: `rows` output channels by T tiles, reducing
    over `channels`): 128 x 64 first where there are 128 rows or more. The interpreter takes one large tile."""
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(rows, 16, 64), 64, clamp_pow2(channels, 16, 64), 4, 1)]
    configs = [GemmConfig(128, 64, 32, 4, 4)] if rows >= 128 else []
    return configs + [GemmConfig(64, 64, 32, 4, 4), GemmConfig(64, 128, 32, 4, 4), GemmConfig(128, 128, 32, 8, 3)]


def winograd_dw_candidates(c_out: int, c_in: int, tiles: int, machine) -> list[GemmConfig]:
    """Tiles and split of the weight gradient's 16 products (c_out x c_in, reducing over the T `tiles`), split
    until about two programs per SM run."""
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(c_out, 16, 64), clamp_pow2(c_in, 16, 64), 64, 4, 1, 2)]
    tried = ((128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3)) if c_out >= 128 else ((64, 64, 4, 4), (64, 128, 4, 4))
    configs = []
    for block_m, block_n, warps, stages in tried:
        programs = -(-c_out // block_m) * -(-c_in // block_n) * POINTS
        configs.append(GemmConfig(block_m, block_n, 32, warps, stages, dw_split(programs, tiles, 32, 2, machine)))
    return list(dict.fromkeys(configs))


def _kernel(cls, constants, num_warps=None, num_stages=None):
    return cached_kernel(cls, *constants, dtype=torch.float32, num_warps=num_warps, num_stages=num_stages)


def _tiles(name, machine):
    return (TILES if machine.gpu else INTERPRETER_TILES)[name]


def _products(config, has_bias):
    return _kernel(Conv2dWinogradProducts, (has_bias, False, config.block_m, config.block_n, config.block_k),
                   config.num_warps, config.num_stages)


def _ranks(p, count):
    """The first config first on planes of at most WINOGRAD_FIRST_PIXELS, else second (so that quick tuning times
    it); the others after every direct config. The interpreter keeps the direct kernels' first guess first."""
    if not p.machine.gpu:
        return [2000 + index for index in range(count)]
    first = -2 if p.OH * p.OW <= WINOGRAD_FIRST_PIXELS else 0.5
    return [first] + [2000 + index for index in range(1, count)]


class _Winograd(Algorithm):
    """A pass that runs where `Problem.winograd` holds, its candidates ranked by `_ranks`."""

    def applies(self, p):
        return p.winograd

    def ranks(self, p, count):
        return _ranks(p, count)


class WinogradForward(_Winograd):
    """y = conv2d(x, weight, bias, padding=1); of a `dx_forward` problem, dx from dy with the convolution's own
    weight [C_IN', C_OUT', 3, 3], transposed and flipped by the weight transform."""

    name = "winograd_forward"

    def candidates(self, p):
        return winograd_candidates(p.C_OUT, p.C_IN, p.machine)

    def kernels(self, p, config):
        return [_kernel(Conv2dWinogradWeight, (p.flip_taps, PAIR_BLOCK)),
                _kernel(Conv2dWinogradInput, (True, *_tiles("input", p.machine))), _products(config, False),
                _kernel(Conv2dWinogradOutput, (p.has_bias, *_tiles("output", p.machine)))]

    def runner(self, p, config):
        weight_transform, input_transform, products, output_transform = (Launcher(k) for k in self.kernels(p, config))
        batch, channels, height, width, rows = p.B, p.C_IN, p.H, p.W, p.C_OUT
        tiles, device, shape = tiles_of(batch, height, width), p.device, p.y_shape
        weight_sizes = (p.C_IN, p.C_OUT) if p.flip_taps else (p.C_OUT, p.C_IN)
        new = allocator(torch.float32, device)

        def run(x, weight, bias, x_cl=None):
            v = new(POINTS, rows, channels)
            weight_transform(weight, v, *weight_sizes)
            u = new(POINTS, tiles, channels)
            input_transform(x, u, batch, channels, height, width)
            m = new(POINTS, rows, tiles)
            products(v, u, m, rows, tiles, channels, 1)
            y = new(*shape)
            output_transform(m, y if bias is None else bias, y, batch, rows, height, width)
            return y

        return run


class WinogradDw(_Winograd):
    """dw (and dbias): the 16 products split over the tiles into fp32 partial rows, then their ordered sum."""

    name = "winograd_dw"

    def candidates(self, p):
        return winograd_dw_candidates(p.C_OUT, p.C_IN, tiles_of(p.B, p.H, p.W), p.machine)

    def kernels(self, p, config):
        return [_kernel(Conv2dWinogradInput, (False, *_tiles("input_c_major", p.machine))),
                _kernel(Conv2dWinogradDy, _tiles("dy", p.machine)), _products(config, p.has_bias),
                _kernel(Conv2dWinogradDwFinish, (p.has_bias, PAIR_BLOCK))]

    def runner(self, p, config):
        input_transform, dy_transform, products, finish = (Launcher(k) for k in self.kernels(p, config))
        batch, c_in, c_out, height, width, split = p.B, p.C_IN, p.C_OUT, p.H, p.W, config.split
        tiles, row = tiles_of(batch, height, width), products_row_size(c_out, c_in, p.has_bias)
        new = allocator(torch.float32, p.device)
        sum_of = summed_weight_gradient(p, finish, new)

        def run(dy, x, copies):
            u = new(POINTS, c_in, tiles)
            input_transform(x, u, batch, c_in, height, width)
            d = new(POINTS, c_out, tiles)
            dy_transform(dy, d, batch, c_out, height, width)
            partial = new(split, row)
            products(d, u, partial, c_out, c_in, tiles, split)
            return sum_of(partial, split, c_out, c_in)

        return run


FORWARD = register(WinogradForward())
DW = register(WinogradDw())
