"""The NCHW implicit GEMM (`ops/conv2d/gemm_*.py`): every convolution, any groups, stride, padding and dilation,
straight from NCHW tensors. The last tier of each pass: what runs where nothing more specialised applies."""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.gemm_dw import Conv2dGemmDw
from ...ops.conv2d.gemm_dx import Conv2dGemmDx
from ...ops.conv2d.gemm_forward import Conv2dGemmForward
from .base import Algorithm, GemmConfig, clamp_pow2, make_kernel, one_launch_dx, one_launch_forward, register
from .partials import dw_split, reduce_kernel, split_weight_gradient


def gemm_candidates(m: int, n: int, k: int, dtype, machine) -> list[GemmConfig]:
    """Configs for an implicit GEMM with M = pixels, N = channels, K = reduction (forward, dx).

    Interpreter: one program over (nearly) all pixels and channels, so the launch has few programs. GPU: 128 x
    N-tile x K-slice tiles with 4 warps (the usual Hopper wgmma shape), K-slices of 64 bytes of fp32 or 128 bytes
    of 16-bit data; the alternatives vary the pixel tile (64, 256), the K slice and the pipeline depth, the
    64-pixel tile and the narrow K slice first (the best or near it on most layers)."""
    block_n = clamp_pow2(n, 16, 128)
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(m, 16, 4096), block_n, clamp_pow2(k, 16, 128), 4, 1)]
    wide = 64 if dtype != torch.float32 else 32
    block_k = clamp_pow2(k, 16, wide)
    narrow = max(16, block_k // 2)
    configs = [
        GemmConfig(128, block_n, block_k, 4 if block_n <= 64 else 8, 3),
        GemmConfig(64, block_n, block_k, 4, 4),
        GemmConfig(128, block_n, narrow, 4, 4),
        GemmConfig(256, block_n, block_k, 8, 3),
        GemmConfig(128, clamp_pow2(n, 16, 256), block_k, 8, 3),
        GemmConfig(256, block_n, narrow, 8, 4),
    ]
    return list(dict.fromkeys(configs))


def dw_candidates(m: int, n: int, pixels: int, groups: int, dtype, machine) -> list[GemmConfig]:
    """Configs for the weight gradient: M = C_OUT/G, N = (C_IN/G)*KH*KW, K = pixels, split over K until about two
    programs per SM run, each slice keeping at least four K-steps so the partial sums stay few."""
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(m, 16, 64), clamp_pow2(n, 16, 128), clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    wide = 64 if dtype != torch.float32 else 32
    configs = []
    for block_m, block_n, block_k, warps, stages, oversubscribe in (
        (64, 64, wide, 4, 3, 2),
        (64, 128, wide, 8, 3, 2),
        (128, 64, wide, 8, 3, 2),
        (64, 64, wide, 4, 4, 4),
        (128, 128, wide, 8, 3, 2),
        (64, 64, wide // 2, 4, 4, 2),
    ):
        block_m = clamp_pow2(m, 16, block_m)
        block_n = clamp_pow2(n, 16, block_n)
        tiles = -(-m // block_m) * -(-n // block_n) * groups
        configs.append(GemmConfig(block_m, block_n, block_k, warps, stages,
                                  dw_split(tiles, pixels, block_k, oversubscribe, machine)))
    return list(dict.fromkeys(configs))


def _gemm_kernel(cls, p, config, *flags):
    """The NCHW GEMM `cls` on p with config's tile: its constants are p's geometry, G, `flags` (HAS_BIAS but for
    dx), TF32 and the tile."""
    constants = p.geometry + (p.groups, *flags, p.tf32, config.block_m, config.block_n, config.block_k)
    return make_kernel(cls, constants, p, config)


class _Anywhere(Algorithm):
    def applies(self, p):
        return True


class GemmForward(_Anywhere):
    name = "gemm_forward"

    def candidates(self, p):
        return gemm_candidates(p.B * p.OH * p.OW, p.C_OUT // p.groups, p.cin_per_group * p.KH * p.KW, p.dtype,
                               p.machine)

    def kernels(self, p, config):
        return [_gemm_kernel(Conv2dGemmForward, p, config, p.has_bias)]

    def runner(self, p, config):
        return one_launch_forward(p, self.kernels(p, config)[0], p.sizes)


class GemmDx(_Anywhere):
    name = "gemm_dx"

    def candidates(self, p):
        pixels = p.B * p.pixels_per_phase
        return gemm_candidates(pixels, p.cin_per_group, p.C_OUT // p.groups * p.KH * p.KW, p.dtype, p.machine)

    def kernels(self, p, config):
        return [_gemm_kernel(Conv2dGemmDx, p, config)]

    def runner(self, p, config):
        return one_launch_dx(p, self.kernels(p, config)[0], p.sizes)


class GemmDw(_Anywhere):
    name = "gemm_dw"

    def candidates(self, p):
        return dw_candidates(p.C_OUT // p.groups, p.cin_per_group * p.KH * p.KW, p.B * p.OH * p.OW, p.groups, p.dtype,
                             p.machine)

    def kernels(self, p, config):
        return [_gemm_kernel(Conv2dGemmDw, p, config, p.has_bias), reduce_kernel(p, p.has_bias)]

    def runner(self, p, config):
        product, reduce = (Launcher(k) for k in self.kernels(p, config))
        return split_weight_gradient(p, config.split, product, reduce, p.launch_sizes, lambda dy, x, copies: (dy, x))


FORWARD = register(GemmForward())
DX = register(GemmDx())
DW = register(GemmDw())
