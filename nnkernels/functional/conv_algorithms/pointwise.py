"""Unpadded one-group 1x1 convolutions as matrix products per image (`ops/conv2d/pointwise.py`): the forward and
dx as [C, pixels] products, dw as a product over the B*OH*OW pixels split into partial rows. Strided ones multiply
x[:, :, ::s, ::s] (a subsampled copy) and spread dx back onto the stride lattice."""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.pointwise import Conv2dPointwise, Conv2dPointwiseDw
from ..layout import subsample_adjoint, subsample_adjoint_kernels, subsample_copy, subsample_kernels
from ..common import allocator
from .base import Algorithm, GemmConfig, clamp_pow2, make_kernel, one_launch_forward, pow2_at_least, register
from .partials import reduce_kernel, split_weight_gradient

# 1x1 products reducing over at most this many channels load the whole reduction once (`m_tiles`).
WHOLE_K_CHANNELS = 64


def pointwise_candidates(c_out: int, c_in: int, pixels: int, dtype, tf32: bool, machine) -> list[GemmConfig]:
    """Tiles of the 1x1 kernels (forward; dx swaps c_out and c_in): BLOCK_M channels x BLOCK_N pixels x BLOCK_K
    reduced channels. First guess: 128-pixel rows keep loads wide, K slices of 128 bytes (64 for fp32); the others
    vary the pixel tile, the warps and the pipeline. A tile's pixels are one image's, so planes under 128 pixels
    get rows of their own size and wider channel tiles instead. Full fp32 (FMA products) also tries num_stages=1
    and a 64-channel tile 4 stages deep first. Where the reduction is at most WHOLE_K_CHANNELS channels, a program
    loads it as one tile for all its output channels (`m_tiles`), first. fp32 with TF32 has its own list. The
    interpreter gets one program per image."""
    if not machine.gpu:
        block_m = clamp_pow2(c_out, 16, 128)
        whole_k = -(-c_out // block_m) if c_in <= WHOLE_K_CHANNELS else 0
        return [GemmConfig(block_m, clamp_pow2(pixels, 16, 4096), clamp_pow2(c_in, 16, 128), 4, 1, m_tiles=whole_k)]
    if dtype == torch.float32 and tf32:
        return _tf32_candidates(c_out, c_in, pixels)
    block_m = clamp_pow2(c_out, 16, 128)
    block_k = clamp_pow2(c_in, 16, 32 if dtype == torch.float32 else 64)
    warps = 8 if block_m >= 128 else 4
    row = clamp_pow2(pixels, 16, 128)
    wider = (GemmConfig(block_m, 256, block_k, 8, 3) if row == 128
             else GemmConfig(clamp_pow2(c_out, 16, 256), row, block_k, 8, 3))
    narrow = clamp_pow2(c_out, 16, 64)
    configs = [GemmConfig(block_m, row, block_k, warps, 3), wider, GemmConfig(narrow, row, block_k, 4, 4)]
    if dtype == torch.float32:
        configs[1:1] = [GemmConfig(block_m, row, block_k, warps, 1), GemmConfig(narrow, row, block_k, 4, 1)]
        configs.insert(0, configs.pop())  # the 64-channel tile, 4 stages
    if c_in <= WHOLE_K_CHANNELS:
        block_m = clamp_pow2(c_out, 16, 64)
        configs.insert(0, GemmConfig(block_m, row, pow2_at_least(max(16, c_in)), 4, 1, m_tiles=-(-c_out // block_m)))
    return list(dict.fromkeys(configs))


def _tf32_candidates(c_out: int, c_in: int, pixels: int) -> list[GemmConfig]:
    """`pointwise_candidates` for fp32 with TF32: [pixels, channels] products whose register operand is the x tile,
    64 pixels first."""
    row = clamp_pow2(pixels, 16, 64)
    wide_row = clamp_pow2(pixels, 16, 128)
    block_m = clamp_pow2(c_out, 16, 64)
    if c_in <= WHOLE_K_CHANNELS:
        block_k = pow2_at_least(max(16, c_in))
        narrow = clamp_pow2(c_out, 16, 32)
        configs = [GemmConfig(block_m, row, block_k, 4, 1, m_tiles=-(-c_out // block_m)),
                   GemmConfig(narrow, row, block_k, 4, 1, m_tiles=-(-c_out // narrow)),
                   GemmConfig(block_m, wide_row, block_k, 4, 1, m_tiles=-(-c_out // block_m))]
    else:
        configs = [GemmConfig(block_m, row, clamp_pow2(c_in, 16, 64), 4, 2), GemmConfig(block_m, row, 32, 4, 4),
                   GemmConfig(block_m, wide_row, 32, 4, 3), GemmConfig(clamp_pow2(c_out, 16, 128), wide_row, 64, 8, 3)]
    return list(dict.fromkeys(configs))


def pointwise_dw_candidates(c_out: int, c_in: int, pixels: int, batch: int, dtype, machine) -> list[GemmConfig]:
    """Tiles and split of the 1x1 weight gradient: C_OUT x C_IN tiles, the B*HW pixels split until about two
    programs per SM run (four for the smaller tiles), each slice keeping at least four steps. Both operands are
    pixel-contiguous, as every tensor-core type wants them."""
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(c_out, 16, 64), clamp_pow2(c_in, 16, 128), clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    block_k = 64 if dtype != torch.float32 else 32
    configs = []
    for block_m, block_n, warps, stages, oversubscribe in ((64, 128, 4, 3, 2), (128, 128, 8, 3, 2), (64, 64, 4, 4, 4),
                                                           (64, 128, 8, 3, 2)):
        block_m, block_n = clamp_pow2(c_out, 16, block_m), clamp_pow2(c_in, 16, block_n)
        tiles = -(-c_out // block_m) * -(-c_in // block_n)
        steps = batch * -(-pixels // block_k)
        split = max(1, min(-(-oversubscribe * machine.sms // tiles), steps // 4))
        configs.append(GemmConfig(block_m, block_n, block_k, warps, stages, split))
    return list(dict.fromkeys(configs))


def product_kernel(p, config, has_bias, *, w_transposed=False, cls=Conv2dPointwise):
    """A 1x1 product kernel of problem p with `config` (also the unfolded dx's, `cls` Conv2dPointwiseFp32Out);
    `w_transposed`: it reads the forward's own weight as its transpose (dx)."""
    constants = ((has_bias,) if cls is Conv2dPointwise else ()) + (p.tf32, w_transposed, config.block_m,
                                                                    config.block_n, config.block_k, config.m_tiles)
    return make_kernel(cls, constants, p, config)


def weight_product_kernel(p, config):
    """The split 1x1 weight-gradient product of problem p (also the unfolded dw's), with its bias sums."""
    return make_kernel(Conv2dPointwiseDw, (p.has_bias, p.tf32, config.block_m, config.block_n, config.block_k), p,
                       config)


def _subsample_kernels(p) -> list:
    """The copy of x[:, :, ::s, ::s] a strided layer's forward and dw make first."""
    return subsample_kernels(p.x_shape, p.stride, p.dtype) if p.subsampled else []


class _Pointwise(Algorithm):
    def applies(self, p):
        # channels-last tensors in 16-channel runs: the NHWC products alone; else both, through copies or masked
        return p.pointwise and not (p.nhwc and p.whole_channel_runs)

    def ranks(self, p, count):
        """The first two ahead of the channels-last candidates they share a tier with, so that quick tuning times
        both kinds; the rest among them."""
        return [index - 2 for index in range(count)]


class PointwiseForward(_Pointwise):
    name = "pointwise_forward"

    def candidates(self, p):
        return pointwise_candidates(p.C_OUT, p.C_IN, p.OH * p.OW, p.dtype, p.tf32, p.machine)

    def kernels(self, p, config):
        return _subsample_kernels(p) + [product_kernel(p, config, p.has_bias)]

    def runner(self, p, config):
        product = one_launch_forward(p, self.kernels(p, config)[-1], (p.B, p.C_IN, p.C_OUT, p.OH * p.OW))
        if not p.subsampled:
            return product
        subsample = subsample_copy(p.x_shape, p.stride, p.dtype, p.device)
        return lambda x, weight, bias: product(subsample(x), weight, bias)


class PointwiseDx(_Pointwise):
    """dx = w^T @ dy per image (the kernel reading w transposed), into dx (or, strided, onto the stride lattice,
    then spread)."""

    name = "pointwise_dx"

    def candidates(self, p):
        return pointwise_candidates(p.C_IN, p.C_OUT, p.OH * p.OW, p.dtype, p.tf32, p.machine)

    def kernels(self, p, config):
        spread = subsample_adjoint_kernels(p.x_shape, p.stride, p.dtype) if p.subsampled else []
        return [product_kernel(p, config, False, w_transposed=True)] + spread

    def runner(self, p, config):
        new = allocator(p.dtype, p.device)
        launch = Launcher(self.kernels(p, config)[0])
        written_shape, sizes = (p.B, p.C_IN, p.OH, p.OW), (p.B, p.C_OUT, p.C_IN, p.OH * p.OW)
        spread = subsample_adjoint(written_shape, p.x_shape, p.stride, p.dtype, p.device) if p.subsampled else None

        def run(dy, weight, dy_cl):
            written = new(*written_shape)
            launch(dy, weight, written, written, *sizes)
            return spread(written) if spread is not None else written

        return run


class PointwiseDw(_Pointwise):
    name = "pointwise_dw"

    def candidates(self, p):
        return pointwise_dw_candidates(p.C_OUT, p.C_IN, p.OH * p.OW, p.B, p.dtype, p.machine)

    def kernels(self, p, config):
        return _subsample_kernels(p) + [weight_product_kernel(p, config), reduce_kernel(p, p.has_bias)]

    def runner(self, p, config):
        product, reduce = (Launcher(k) for k in self.kernels(p, config)[-2:])
        subsample = subsample_copy(p.x_shape, p.stride, p.dtype, p.device) if p.subsampled else None
        return split_weight_gradient(p, config.split, product, reduce, (p.B, p.C_IN, p.C_OUT, p.OH * p.OW),
                                     lambda dy, x, copies: (dy, subsample(x) if subsample is not None else x))


FORWARD = register(PointwiseForward())
DX = register(PointwiseDx())
DW = register(PointwiseDw())
