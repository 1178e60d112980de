"""NCHW batch norm with frozen (running) statistics, split like the training kernels so that
every shape fills the GPU: `BatchNorm2dEvalForward`, `BatchNorm2dEvalBackward`,
`BatchNorm2dSumPartials`. Tiles and chunks as in `batch_norm2d_train`; statistics in fp32. Channels
that fit one tile take `BatchNorm2dEvalForwardGrouped` and `BatchNorm2dEvalBackwardGrouped`: several
channels per program, laid out as the training kernels' fused tiles (`grouped_plan`; the functional op
tunes the channels per program and num_warps).

rstd[c] = 1 / sqrt(running_var[c] + eps); y = (x - running_mean) * weight * rstd + bias;
dx = weight * rstd * dy; dweight = sum(dy * (x - running_mean) * rstd); dbias = sum(dy).
"""
import torch
import triton
import triton.language as tl

from ...kernel import kernel_object
from .train import (
    CHUNK_WALK,
    FUSED_HELPERS,
    channel_tile,
    chunk_grad_lane_sums,
    chunk_tiles,
    channel_group_tile,
    channel_sums,
    check_activations,
    check_channel_tensors,
    fused_entry,
    split_chunks,
)
from ..common.host_math import cdiv

F32 = torch.float32


def eval_entry(k, a):
    """Grid [C, chunks] with chunks = cdiv(tiles per channel, TILES_PER_CHUNK)."""
    check_activations(a, ("x", "y", "dy", "dx"))
    check_channel_tensors(a, ("weight", "bias", "running_mean", "running_var"), a.C)
    if not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")
    num_chunks = split_chunks(k, a)
    if hasattr(a, "partial_dweight"):
        check_channel_tensors(a, ("partial_dweight", "partial_dbias"), a.C * num_chunks, "C*chunks")
    return (a.C, num_chunks)


def sum_partials_entry(k, a):
    """Grid [cdiv(C, BLOCK_C)]; all NUM_PARTIALS partials of a channel fit one BLOCK_PARTIALS row."""
    check_channel_tensors(a, ("partial_dweight", "partial_dbias"), a.C * a.NUM_PARTIALS, "C*NUM_PARTIALS")
    check_channel_tensors(a, ("dweight", "dbias"), a.C)
    if a.NUM_PARTIALS > k.block_partials:
        raise ValueError(f"NUM_PARTIALS: expected at most block_partials = {k.block_partials}, got {a.NUM_PARTIALS}")
    return (cdiv(a.C, k.block_c),)


@triton.jit
def batch_norm2d_eval_forward(
    x, y, weight, bias, running_mean, running_var, B, C, HW, TILES_PER_CHUNK, eps,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Batch norm forward with frozen statistics.

    Grid: [C, chunks]. Program (c, chunk) writes, on the tiles of its chunk,
        y = x * scale + shift,  scale = weight[c] * rstd[c],  shift = bias[c] - running_mean[c] * scale,
    rstd = 1 / sqrt(running_var[c] + eps), in fp32. Every y is written.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + c) + eps))
    scale = tl.load(weight + c) * channel_rstd
    shift = tl.load(bias + c) - tl.load(running_mean + c) * scale
    first, last, hw_tiles = chunk_tiles(chunk, B, HW, TILES_PER_CHUNK, BLOCK_B, BLOCK_HW)
    for t in range(first, last):
        offsets, inside = channel_tile(t, hw_tiles, c, B, C, HW, BLOCK_B, BLOCK_HW)
        xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + offsets, (xv * scale + shift).to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_eval_backward(
    dy, x, dx, weight, running_mean, running_var, partial_dweight, partial_dbias, B, C, HW, TILES_PER_CHUNK, eps,
    BLOCK_B: tl.constexpr, BLOCK_HW: tl.constexpr,
):
    """Batch norm backward with frozen statistics, one pass over dy and x.

    Grid: [C, chunks]. Program (c, chunk) writes dx = weight[c] * rstd[c] * dy on its tiles and
        partial_dbias[c * chunks + chunk]   = sum over its tiles of dy
        partial_dweight[c * chunks + chunk] = rstd[c] * sum over its tiles of dy * (x - running_mean[c])
    (fp32, lane by lane, then one reduction). With one chunk the partials are dweight and dbias.
    """
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    channel_mean = tl.load(running_mean + c)
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + c) + eps))
    dy_scale = tl.load(weight + c) * channel_rstd
    sum_dy, sum_dy_xmu = chunk_grad_lane_sums(dy, x, dx, dy_scale, channel_mean, c, chunk, B, C, HW, TILES_PER_CHUNK,
                                              BLOCK_B, BLOCK_HW)
    slot = c * tl.num_programs(1) + chunk
    tl.store(partial_dbias + slot, tl.sum(tl.sum(sum_dy, axis=1), axis=0))
    tl.store(partial_dweight + slot, channel_rstd * tl.sum(tl.sum(sum_dy_xmu, axis=1), axis=0))


@triton.jit
def batch_norm2d_sum_partials(
    partial_dweight, partial_dbias, dweight, dbias, C, NUM_PARTIALS,
    BLOCK_C: tl.constexpr, BLOCK_PARTIALS: tl.constexpr,
):
    """Sum per-chunk partials into per-channel results, in a fixed order.

    Grid: [cdiv(C, BLOCK_C)]. One program writes, for its BLOCK_C channels,
        dweight[c] = sum over k < NUM_PARTIALS of partial_dweight[c * NUM_PARTIALS + k]  (dbias likewise).
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_PARTIALS)
    inside = (c < C)[:, None] & (k < NUM_PARTIALS)[None, :]
    slots = c[:, None] * NUM_PARTIALS + k[None, :]
    tl.store(dweight + c, tl.sum(tl.load(partial_dweight + slots, mask=inside, other=0.0), axis=1), mask=c < C)
    tl.store(dbias + c, tl.sum(tl.load(partial_dbias + slots, mask=inside, other=0.0), axis=1), mask=c < C)


@triton.jit
def batch_norm2d_eval_forward_grouped(
    x, y, weight, bias, running_mean, running_var, B, C, HW, CHANNELS, eps,
    BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, VECTOR: tl.constexpr,
):
    """Batch norm forward with frozen statistics, for channels that fit one tile.

    Grid: [cdiv(C, CHANNELS)]. Program p writes y of channels c0..c0+CHANNELS-1 from one [BLOCK_B, BLOCK_J]
    tile of x (the fused tiles of batch_norm2d_train):
        y = x * scale + shift,  scale = weight[c] * rstd[c],  shift = bias[c] - running_mean[c] * scale,
    rstd = 1 / sqrt(running_var[c] + eps), in fp32, per column. Every y is written.
    """
    c0, offsets, inside, column_channel, in_row = channel_group_tile(B, C, HW, CHANNELS, BLOCK_B, BLOCK_J, VECTOR)
    c = c0 + column_channel
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + c, mask=in_row, other=1.0) + eps))
    scale = tl.load(weight + c, mask=in_row, other=0.0) * rstd
    shift = tl.load(bias + c, mask=in_row, other=0.0) - tl.load(running_mean + c, mask=in_row, other=0.0) * scale
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(y + offsets, (xv * scale[None, :] + shift[None, :]).to(y.dtype.element_ty), mask=inside)


@triton.jit
def batch_norm2d_eval_backward_grouped(
    dy, x, dx, weight, running_mean, running_var, dweight, dbias, B, C, HW, CHANNELS, eps,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, VECTOR: tl.constexpr,
):
    """Batch norm backward with frozen statistics, for channels that fit one tile: one pass over dy and x.

    Grid: [cdiv(C, CHANNELS)]. Program p loads dy and x of channels c0..c0+CHANNELS-1, each as one
    [BLOCK_B, BLOCK_J] tile (the fused tiles of batch_norm2d_train), and writes dx = weight[c] * rstd[c] * dy,
        dbias[c] = sum(dy),  dweight[c] = rstd[c] * sum(dy * (x - running_mean[c])),
    rstd = 1 / sqrt(running_var[c] + eps), sums in fp32 segmented by `channel_sums`. Every dx is written.
    """
    c0, offsets, inside, column_channel, in_row = channel_group_tile(B, C, HW, CHANNELS, BLOCK_B, BLOCK_J, VECTOR)
    k = tl.arange(0, BLOCK_C)
    member = column_channel[:, None] == k[None, :]
    c = c0 + k
    c_in = (k < CHANNELS) & (c < C)
    column_c = c0 + column_channel
    column_rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + column_c, mask=in_row, other=1.0) + eps))
    dy_scale = tl.load(weight + column_c, mask=in_row, other=0.0) * column_rstd
    column_mean = tl.load(running_mean + column_c, mask=in_row, other=0.0)
    dyv = tl.load(dy + offsets, mask=inside, other=0.0).to(tl.float32)
    xv = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(dx + offsets, (dyv * dy_scale[None, :]).to(dx.dtype.element_ty), mask=inside)
    xmu = tl.where(inside, xv - column_mean[None, :], 0.0)
    channel_rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.load(running_var + c, mask=c_in, other=1.0) + eps))
    tl.store(dbias + c, channel_sums(tl.sum(dyv, axis=0), member), mask=c_in)
    tl.store(dweight + c, channel_rstd * channel_sums(tl.sum(dyv * xmu, axis=0), member), mask=c_in)


_STATS = {n: F32 for n in ("weight", "bias", "running_mean", "running_var", "partial_dweight", "partial_dbias",
                           "dweight", "dbias")}

BatchNorm2dEvalForward = kernel_object(
    batch_norm2d_eval_forward, entry=eval_entry, example=(8, 256), floats=("eps",), pointer_dtypes=_STATS,
    helpers=CHUNK_WALK)
BatchNorm2dEvalBackward = kernel_object(
    batch_norm2d_eval_backward, entry=eval_entry, example=(8, 256), floats=("eps",), pointer_dtypes=_STATS,
    helpers=(chunk_grad_lane_sums, *CHUNK_WALK))
BatchNorm2dSumPartials = kernel_object(
    batch_norm2d_sum_partials, entry=sum_partials_entry, example=(16, 64), pointer_dtypes=_STATS)
BatchNorm2dEvalForwardGrouped = kernel_object(
    batch_norm2d_eval_forward_grouped, entry=fused_entry, example=(32, 256, 4), floats=("eps",),
    pointer_dtypes=_STATS, num_warps=8, helpers=(channel_group_tile,))
BatchNorm2dEvalBackwardGrouped = kernel_object(
    batch_norm2d_eval_backward_grouped, entry=fused_entry, example=(4, 32, 256, 4), floats=("eps",),
    pointer_dtypes=_STATS, num_warps=8, helpers=FUSED_HELPERS)
