"""Backward passes as 1x1 products of the unfolded input (im2col, `ops/conv2d/unfold.py`).

- Few input channels on large planes (the RGB stem), where an implicit GEMM's C_IN tile is mostly padding: dx as
  fp32 columns w^T @ dy folded back onto dx, dw as the product of dy and the columns.
- fp32 weight gradients of small planes (stride 1, channels-last shapes): one product over all B*OH*OW pixels of
  the columns and dy laid out rows-outer ([rows, B, OH, OW]), a reduction the tensor cores read in runs.
The columns are made a slice of the batch at a time, at most UNFOLD_SLICE_BYTES each, which bounds the scratch.
"""
from __future__ import annotations

import torch

from ...launcher import Launcher
from ...ops.conv2d.pointwise import Conv2dPointwiseFp32Out
from ..unfold import fold_kernel, folder, unfold_copy, unfold_kernel
from ..common import allocator
from .base import Algorithm, GemmConfig, clamp_pow2, register
from .partials import partial_row, reduce_kernel, summed_weight_gradient
from .pointwise import pointwise_candidates, pointwise_dw_candidates, product_kernel, weight_product_kernel

UNFOLD_SLICE_BYTES = 2**30
# The unfold geometry that lays dy out rows-outer: a 1x1 window, stride 1, no padding.
ROWS_OUTER_COPY = (1, 1, 1, 1, 0, 0, 1, 1)


def unfold_slices(p, element_size):
    """[first, end) slices of the batch whose columns (n*C_IN*KH*KW*OH*OW elements) take at most
    UNFOLD_SLICE_BYTES, at least one image each."""
    step = max(1, UNFOLD_SLICE_BYTES // (p.unfolded_rows * p.OH * p.OW * element_size))
    return [(first, min(first + step, p.B)) for first in range(0, p.B, step)]


def rows_outer_dw_candidates(c_out: int, rows: int, pixels: int, dtype, machine) -> list[GemmConfig]:
    """Tiles and split of the weight gradient as one 1x1 product over `pixels` (rows-outer columns): C_OUT x rows
    tiles, split as `pointwise_dw_candidates` splits and more, since the products are few per program. The first
    three hold full fp32's best and a TF32 tile near TF32's."""
    if not machine.gpu:
        return pointwise_dw_candidates(c_out, rows, pixels, 1, dtype, machine)
    block_k = 64 if dtype != torch.float32 else 32
    steps = -(-pixels // block_k)

    def tile(block_m, block_n, warps, stages, splits):
        block_m, block_n = clamp_pow2(c_out, 16, block_m), clamp_pow2(rows, 16, block_n)
        split = -(-2 * machine.sms // (-(-c_out // block_m) * -(-rows // block_n)))
        return [GemmConfig(block_m, block_n, block_k, warps, stages, max(1, min(split * k, steps // 4)))
                for k in splits]

    square, wide = tile(128, 128, 8, 3, (1, 2)), tile(128, 64, 4, 3, (4, 1, 2))
    configs = [square[0], wide[0], square[1], *wide[1:], *tile(64, 128, 4, 3, (1,)), *tile(64, 64, 4, 4, (1,))]
    return list(dict.fromkeys(configs))


class UnfoldedDx(Algorithm):
    name = "unfolded_dx"

    def applies(self, p):
        return p.unfolded

    def candidates(self, p):
        return pointwise_candidates(p.unfolded_rows, p.C_OUT, p.OH * p.OW, p.dtype, p.tf32, p.machine)

    def kernels(self, p, config):
        return [product_kernel(p, config, False, w_transposed=True, cls=Conv2dPointwiseFp32Out),
                fold_kernel(p.geometry, p.H, p.W, p.dtype)]

    def runner(self, p, config):
        product = self.kernels(p, config)[0]
        out_size, slices = (p.OH, p.OW), unfold_slices(p, 4)
        parts = []
        for first, end in slices:
            parts.append((first, end, Launcher(product),
                          folder((end - first, p.C_IN, p.H, p.W), p.geometry, out_size, p.dtype)))
        c_out, rows, pixels, device = p.C_OUT, p.unfolded_rows, p.OH * p.OW, p.device
        shape, new, new_f32 = p.x_shape, allocator(p.dtype, device), allocator(torch.float32, device)

        def run(dy, weight, dy_cl):
            dx = new(*shape)
            for first, end, launch, fold in parts:
                columns = new_f32(end - first, rows, *out_size)
                launch(dy[first:end], weight, columns, end - first, c_out, rows, pixels)
                fold(columns, dx[first:end])
            return dx

        return run


class UnfoldedDw(Algorithm):
    name = "unfolded_dw"

    def applies(self, p):
        return p.unfolded_dw

    def candidates(self, p):
        smallest_slice = min(end - first for first, end in unfold_slices(p, p.dtype.itemsize))
        if p.rows_outer_dw:
            return rows_outer_dw_candidates(p.C_OUT, p.unfolded_rows, smallest_slice * p.OH * p.OW, p.dtype, p.machine)
        return pointwise_dw_candidates(p.C_OUT, p.unfolded_rows, p.OH * p.OW, smallest_slice, p.dtype, p.machine)

    def kernels(self, p, config):
        out_size = (p.OH, p.OW)
        # In launch order: the runner unfolds dy's rows (rows-outer only) before x's columns.
        copies = [unfold_kernel(ROWS_OUTER_COPY, out_size, p.dtype, True)] if p.rows_outer_dw else []
        copies.append(unfold_kernel(p.geometry, out_size, p.dtype, p.rows_outer_dw))
        return copies + [weight_product_kernel(p, config), reduce_kernel(p, p.has_bias)]

    def runner(self, p, config):
        kernels = self.kernels(p, config)
        product_kernel_, reduce = kernels[-2], Launcher(kernels[-1])
        out_size, plane, rows_outer, split = (p.OH, p.OW), p.OH * p.OW, p.rows_outer_dw, config.split
        slices = unfold_slices(p, p.dtype.itemsize)
        parts = []
        for first, end in slices:
            images = end - first
            columns = unfold_copy((images, p.C_IN, p.H, p.W), p.geometry, out_size, p.dtype, p.device, rows_outer)
            grad_rows = (unfold_copy((images, p.C_OUT, p.OH, p.OW), ROWS_OUTER_COPY, out_size, p.dtype, p.device, True)
                         if rows_outer else None)
            sizes = (1, images * plane) if rows_outer else (images, plane)
            parts.append((first, end, columns, grad_rows, sizes, Launcher(product_kernel_)))
        row, c_out, rows = partial_row(p, p.has_bias), p.C_OUT, p.unfolded_rows
        n_dw, total_rows = p.C_OUT * p.cin_per_group * p.KH * p.KW, len(slices) * split
        new_f32 = allocator(torch.float32, p.device)
        sum_of = summed_weight_gradient(p, reduce, allocator(p.dtype, p.device))

        def run(dy, x, copies):
            partial = new_f32(total_rows, row)
            for index, (first, end, columns, grad_rows, (images, pixels), launch) in enumerate(parts):
                dy_part = dy[first:end]
                launch(grad_rows(dy_part) if grad_rows is not None else dy_part, columns(x[first:end]),
                       partial[index * split:(index + 1) * split], images, rows, c_out, pixels, split)
            return sum_of(partial, total_rows, n_dw, c_out)

        return run


DX = register(UnfoldedDx())
DW = register(UnfoldedDw())
