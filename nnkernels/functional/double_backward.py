"""Gradients that are themselves differentiable: what the ops' backwards compute where autograd records a graph
(`torch.autograd.grad(..., create_graph=True)`: gradient penalties, meta-learning), in place of the plans'
kernels, whose results carry no graph.

- conv2d: dx and dw as nnkernels convolutions (so their derivatives run on nnkernels' kernels too, to any order),
  dbias a sum;
- avg_pool2d: dx is linear in dy, P^T dy: the plan's backward kernel, whose own derivative is its adjoint P, the
  forward avg_pool2d (`Linear`);
- batch_norm: torch ops, with the batch statistics recomputed from x so that their derivatives are in the graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.autograd.Function):
    """`apply(v)` for a linear map whose adjoint (the derivative's transpose) is `adjoint`: d<g, apply(v)>/dv =
    adjoint(g). Both run differentiably where they are themselves differentiable ops."""

    @staticmethod
    def forward(ctx, v, apply, adjoint):
        ctx.adjoint = adjoint
        return apply(v)

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g), None, None


# ---- conv2d ----

def conv2d_grads(dy, x, weight, stride, padding, dilation, groups, needs):
    """(dx, dw, dbias) of `nnkernels.functional.conv2d` for 4-D dy and x, each None where `needs` (dx, dw, dbias)
    does not ask for it, as differentiable convolutions on nnkernels' kernels."""
    if x.shape[0] == 0:  # no work, and no convolution over an empty batch to write it as: torch's formula
        grads = torch.ops.aten.convolution_backward(dy, x, weight, None, list(stride), list(padding), list(dilation),
                                                    False, [0, 0], groups, list(needs))
        return tuple(grad if need else None for grad, need in zip(grads, needs))
    from .conv import conv2d

    need_dx, need_dw, need_dbias = needs
    dx = _conv2d_dx(conv2d, dy, weight, x.shape[2:], stride, padding, dilation, groups) if need_dx else None
    dw = _conv2d_dw(conv2d, dy, x, weight.shape[2:], stride, padding, dilation, groups) if need_dw else None
    return dx, dw, dy.sum((0, 2, 3)) if need_dbias else None


def _conv2d_dx(conv2d, dy, weight, size, stride, padding, dilation, groups):
    """dx = dy, zero-inserted by the stride, convolved with the weight transposed in its channels (per group) and
    flipped in its taps, dilated as the forward, padded by dilation*(k-1) - padding on each side and by the rows
    and columns of x no output reaches at the end; negative padding crops."""
    c_out, cin_per_group, kh, kw = weight.shape
    transposed = (weight.reshape(groups, c_out // groups, cin_per_group, kh, kw).transpose(1, 2)
                  .reshape(groups * cin_per_group, c_out // groups, kh, kw).flip(2, 3))
    spread = _zero_inserted(dy, stride)
    pads, common = [], []
    for axis, k in enumerate((kh, kw)):
        before = dilation[axis] * (k - 1) - padding[axis]
        reached = spread.shape[2 + axis] + 2 * before - dilation[axis] * (k - 1)
        after = before + size[axis] - reached
        shared = max(0, min(before, after))  # what the convolution pads itself
        common.append(shared)
        pads.append((before - shared, after - shared))
    if any(pads[0] + pads[1]):
        spread = F.pad(spread, (*pads[1], *pads[0]))
    return conv2d(spread, transposed, None, 1, tuple(common), dilation, groups)


def _zero_inserted(dy, stride):
    """dy with stride - 1 zero rows (columns) between its rows (columns): what a stride-1 convolution of dy needs
    to reach the inputs a strided forward read."""
    if stride == (1, 1):
        return dy
    B, C, OH, OW = dy.shape
    spread = dy.new_zeros(B, C, (OH - 1) * stride[0] + 1, (OW - 1) * stride[1] + 1)
    spread[:, :, ::stride[0], ::stride[1]] = dy
    return spread


def _conv2d_dw(conv2d, dy, x, kernel, stride, padding, dilation, groups):
    """dw[co, ci, kh, kw] = sum over b, oh, ow of dy[b, co, oh, ow] * x[b, ci, oh*s - p + kh*d, ow*s - p + kw*d]:
    a convolution of x's channels (as its batch; group and image as its channels) with dy's channels (image as
    their input channel) as the weight, the forward's stride as its dilation and dilation as its stride, padded
    as the forward, cropped to the kernel's taps."""
    B, c_in, H, W = x.shape
    cin_per_group = c_in // groups
    images = (x.reshape(B, groups, cin_per_group, H, W).permute(2, 1, 0, 3, 4)
              .reshape(cin_per_group, groups * B, H, W))
    taps = conv2d(images, dy.transpose(0, 1), None, dilation, padding, stride, groups)
    return taps[:, :, :kernel[0], :kernel[1]].transpose(0, 1)


# ---- avg_pool2d ----

def avg_pool2d_dx(dy, backward, window):
    """dx = P^T dy by `backward` (the plan's kernel), differentiable: its derivative is avg_pool2d with `window`
    (kernel, stride, padding, ceil_mode, count_include_pad, divisor or 0), on nnkernels' kernels."""
    from .pooling import avg_pool2d

    kernel, stride, padding, ceil_mode, count_include_pad, divisor = window
    return Linear.apply(dy, backward, lambda g: avg_pool2d(g, kernel, stride, padding, ceil_mode, count_include_pad,
                                                           divisor or None))


# ---- batch_norm ----

def _reduced(x):
    return [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)


def batch_norm_train_grads(dy, x, weight, eps):
    """(dx, dweight, dbias) of training-mode batch norm (fp32 statistics recomputed from x, dweight and dbias fp32),
    in torch ops: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * weight."""
    dims, channel = _reduced(x)
    x32, dy32 = x.float(), dy.float()
    centred = x32 - x32.mean(dims, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)
    xhat = centred * rstd
    dxhat = dy32 if weight is None else dy32 * weight.float().view(channel)
    dx = rstd * (dxhat - dxhat.mean(dims, keepdim=True) - xhat * (dxhat * xhat).mean(dims, keepdim=True))
    return dx.to(x.dtype), (dy32 * xhat).sum(dims), dy32.sum(dims)


def batch_norm_eval_grads(dy, x, weight, running_mean, running_var, eps):
    """(dx, dweight, dbias) of evaluation-mode batch norm in torch ops: dx = dy * weight * rstd, rstd =
    1/sqrt(running_var + eps), dweight = sum(dy * (x - running_mean) * rstd), dbias = sum(dy)."""
    dims, channel = _reduced(x)
    dy32 = dy.float()
    rstd = torch.rsqrt(running_var + eps).view(channel)
    scale = rstd if weight is None else rstd * weight.float().view(channel)
    dweight = (dy32 * (x.float() - running_mean.view(channel)) * rstd).sum(dims)
    return (dy32 * scale).to(x.dtype), dweight, dy32.sum(dims)
