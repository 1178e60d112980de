"""Channels-last inputs to avg_pool2d and batch_norm: outputs and input gradients in the memory format torch's
own ops give (judged as torch judges it, `is_contiguous(memory_format=...)` both ways, which also covers the
shapes where NCHW and NHWC strides coincide), with the values of the NCHW path within rounding: the channels-last
kernels of both ops sum in another order."""
import pytest
import torch
import torch.nn.functional as F

from nnkernels.functional import avg_pool2d, batch_norm
from support import DEVICE, assert_close, randn

CL = torch.channels_last


def channels_last(*shape):
    """Fresh random data in NHWC storage, made as torch.empty(memory_format=channels_last) makes it (so a 1x1
    plane gets NHWC strides, not NCHW's)."""
    return torch.empty(shape, device=DEVICE, memory_format=CL).copy_(randn(*shape))


def formats(t):
    return t.is_contiguous(), t.is_contiguous(memory_format=CL)


def check(ours, theirs, x, dy_format):
    """ours(x) against ours(x in NCHW) (the same values within rounding) and theirs(x) (the same formats), for y
    and dx, dy given in `dy_format`."""
    results = []
    for fn, source in ((ours, x), (ours, x.contiguous()), (theirs, x)):
        leaf = source.detach().requires_grad_()
        y = fn(leaf)
        dy = randn(*y.shape, generator=torch.Generator().manual_seed(0)).to(y.dtype).contiguous(
            memory_format=dy_format)
        results.append((y, torch.autograd.grad(y, leaf, dy)[0]))
    (y, dx), (y_nchw, dx_nchw), (y_torch, dx_torch) = results
    assert_close(y, y_nchw)
    assert_close(dx, dx_nchw)
    assert formats(y) == formats(y_torch), (y.stride(), y_torch.stride())
    assert formats(dx) == formats(dx_torch), (dx.stride(), dx_torch.stride())


SHAPES = [pytest.param((2, 3, 6, 5), id="2x3x6x5"), pytest.param((1, 3, 4, 4), id="batch1"),
          pytest.param((2, 3, 1, 1), id="1x1-plane"), pytest.param((2, 1, 4, 4), id="one-channel")]


@pytest.mark.parametrize("dy_format", [CL, torch.contiguous_format], ids=["dy-nhwc", "dy-nchw"])
@pytest.mark.parametrize("shape", SHAPES)
def test_avg_pool2d_keeps_channels_last(shape, dy_format):
    kernel = 1 if shape[2] == 1 else 2
    check(lambda x: avg_pool2d(x, kernel, ceil_mode=True), lambda x: F.avg_pool2d(x, kernel, ceil_mode=True),
          channels_last(*shape), dy_format)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_keeps_channels_last(shape, training):
    C = shape[1]
    weight, bias, mean, var = randn(C), randn(C), randn(C), torch.rand(C, device=DEVICE) + 0.5
    check(lambda x: batch_norm(x, mean.clone(), var.clone(), weight, bias, training=training),
          lambda x: F.batch_norm(x, mean.clone(), var.clone(), weight, bias, training=training),
          channels_last(*shape), CL)


def test_nchw_inputs_stay_nchw():
    x = randn(2, 3, 4, 4)
    assert avg_pool2d(x, 2).is_contiguous() and batch_norm(x, None, None, training=True).is_contiguous()
