"""Few-channel convolutions on large planes (the RGB stem) one output row per program on the GPU
(`ops/conv2d/rows_forward.py`): K slices of whole input rows, so the 3-channel reduction fills the tensor cores."""
from __future__ import annotations

import torch

from ...ops.conv2d.rows_forward import Conv2dRowsForward
from .base import Algorithm, GemmConfig, clamp_pow2, make_kernel, one_launch_forward, pow2_at_least, register


def rows_forward_candidates(ow: int, c_out: int, kw: int, dtype, machine) -> list[GemmConfig]:
    """Configs for `Conv2dRowsForward`: block_m columns of one output row, block_n output channels, K slices
    (block_k) of whole input rows, each `pow2_at_least(kw)` taps wide. Interpreter: the whole row and all channels
    in one program. GPU: 16-bit 64 columns, two rows a slice, 4 warps, 2 stages first; full fp32 (three TF32
    products, more registers) 64 columns with 2 warps."""
    span = pow2_at_least(kw)
    block_n = clamp_pow2(c_out, 16, 128)
    rows2, rows4, rows8 = (max(k, span) for k in (16, 32, 64))
    if not machine.gpu:
        return [GemmConfig(clamp_pow2(ow, 16, 1024), block_n, rows2, 4, 1)]
    wide = clamp_pow2(ow, 16, 128)
    half = max(16, wide // 2)
    if dtype == torch.float32:
        configs = [GemmConfig(half, block_n, rows2, 2, 3), GemmConfig(half, block_n, rows8, 4, 3),
                   GemmConfig(half, block_n, rows2, 2, 2), GemmConfig(wide, block_n, rows2, 4, 4)]
    else:
        configs = [GemmConfig(half, block_n, rows2, 4, 2), GemmConfig(wide, block_n, rows4, 4, 3),
                   GemmConfig(wide, block_n, rows2, 4, 4), GemmConfig(half, block_n, rows2, 2, 3)]
    return list(dict.fromkeys(configs))


class RowsForward(Algorithm):
    name = "rows_forward"

    def applies(self, p):
        return p.rows_forward

    def candidates(self, p):
        return rows_forward_candidates(p.OW, p.C_OUT, p.KW, p.dtype, p.machine)

    def kernels(self, p, config):
        constants = p.geometry + (p.has_bias, p.tf32, config.block_m, config.block_n, config.block_k,
                                  pow2_at_least(p.KW))
        return [make_kernel(Conv2dRowsForward, constants, p, config)]

    def runner(self, p, config):
        return one_launch_forward(p, self.kernels(p, config)[0], p.sizes)


FORWARD = register(RowsForward())
