"""Batch norm on small spatial sizes: the fused kernels that take several channels per program as one
[batch, CHANNELS*HW] tile (training forward and backward, frozen-statistics forward and backward),
against torch.nn.functional.batch_norm in float64, on poisoned outputs."""
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from nnkernels.ops.batch_norm2d_eval import BatchNorm2dEvalBackwardGrouped, BatchNorm2dEvalForwardGrouped
from nnkernels.ops.batch_norm2d_train import (
    FUSED_MIN_PROGRAMS,
    FUSED_TILE,
    BatchNorm2dTrainBackwardFused,
    BatchNorm2dTrainForwardFused,
    _fused_channels,
    batch_norm_plan,
    group_vector,
)
from support import DTYPES, assert_close, dtype_id, poisoned, randn

bn = importlib.import_module("nnkernels.functional.batch_norm")  # the module; the package re-exports the function

STATS_TOL = 2e-5  # fp32 per-channel results, as in test_batch_norm_train


def test_plan_for_b32_c2048_7x7_loads_aligned_rows_of_several_channels():
    """The GPU plan of the benchmark's 7x7 layer: 4 channels (196 contiguous elements per image, 16-byte
    aligned in fp32, 8-byte in bf16) per program, 512 programs of one [32, 256] tile."""
    for element_size, vector in ((4, 4), (2, 4)):
        channels = _fused_channels(32, 2048, 49, element_size, FUSED_TILE, FUSED_MIN_PROGRAMS)
        assert channels == 4
        assert group_vector(2048, 49, channels, element_size) == vector
    # 7 channels per program would use more lanes (343 of 512) but only 4-byte rows: 4 wins.
    assert group_vector(2048, 49, 7, 4) == 1


def _kernels(dtype, B, C, HW, channels):
    plan = batch_norm_plan(B, C, HW, element_size=dtype.itemsize, channels=channels)
    assert plan.fused and plan.channels == channels
    grouped = (plan.block_c, plan.block_b, plan.block_j, plan.vector)
    train = [cls(*grouped, dtype=dtype) for cls in (BatchNorm2dTrainForwardFused, BatchNorm2dTrainBackwardFused)]
    return train + [BatchNorm2dEvalForwardGrouped(*grouped[1:], dtype=dtype),
                   BatchNorm2dEvalBackwardGrouped(*grouped, dtype=dtype)]


# (B, C, H, W, channels per program): HW = 15 with 7 channels in groups of 3 (the last holds one);
# a batch of 1 with groups of 4 channels whose rows start at multiples of 4 elements (vector > 1).
SHAPES = [(3, 7, 5, 3, 3), (1, 8, 2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fused_kernels_match_float64(dtype, shape):
    B, C, H, W, channels = shape
    HW = H * W
    train_forward, train_backward, eval_forward, eval_backward = _kernels(dtype, B, C, HW, channels)
    x = (randn(B, C, H, W) * 2 + 3).to(dtype)
    dy = randn(B, C, H, W, dtype=dtype)
    weight, bias = randn(C), randn(C)
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    x64, dy64 = x.double().requires_grad_(), dy.double()

    y, dx = poisoned(B, C, H, W, dtype=dtype), poisoned(B, C, H, W, dtype=dtype)
    mean, rstd, var_unbiased, dweight, dbias = (poisoned(C) for _ in range(5))
    train_forward.launch(x, y, weight, bias, mean, rstd, var_unbiased, B, C, HW, channels, 1e-5)
    train_backward.launch(dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, channels)
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    y64 = F.batch_norm(x64, None, None, w64, b64, True, 0.1, 1e-5)
    y64.backward(dy64)
    assert_close(y, y64, dtype)
    assert_close(mean, x64.detach().mean((0, 2, 3)), tol=STATS_TOL)
    assert_close(rstd, (x64.detach().var((0, 2, 3), unbiased=False) + 1e-5).rsqrt(), tol=STATS_TOL)
    assert_close(var_unbiased, x64.detach().var((0, 2, 3), unbiased=True), tol=STATS_TOL)
    assert_close(dx, x64.grad, dtype)
    assert_close(dweight, w64.grad, tol=STATS_TOL)
    assert_close(dbias, b64.grad, tol=STATS_TOL)

    y, dx = poisoned(B, C, H, W, dtype=dtype), poisoned(B, C, H, W, dtype=dtype)
    dweight, dbias = poisoned(C), poisoned(C)
    eval_forward.launch(x, y, weight, bias, running_mean, running_var, B, C, HW, channels, 1e-5)
    eval_backward.launch(dy, x, dx, weight, running_mean, running_var, dweight, dbias, B, C, HW, channels, 1e-5)
    x64.grad = None
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    y64 = F.batch_norm(x64, running_mean.double(), running_var.double(), w64, b64, False, 0.1, 1e-5)
    y64.backward(dy64)
    assert_close(y, y64, dtype)
    assert_close(dx, x64.grad, dtype)
    assert_close(dweight, w64.grad, tol=STATS_TOL)
    assert_close(dbias, b64.grad, tol=STATS_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_functional_training_updates_running_stats_like_pytorch(dtype, monkeypatch):
    """nnkernels.batch_norm with 4 channels per program over C = 10 (the last program holds 2), 7x7."""
    monkeypatch.setattr(bn, "batch_norm_plan", functools.partial(batch_norm_plan, channels=4))
    B, C, H, W = 2, 10, 7, 7
    x = (randn(B, C, H, W) - 1).to(dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    dy = randn(B, C, H, W, dtype=dtype)
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    ref_mean, ref_var = running_mean.double(), running_var.double()
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y = bn.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.3)
    y.backward(dy)
    y64 = F.batch_norm(leaves64[0], ref_mean, ref_var, *leaves64[1:], training=True, momentum=0.3)
    y64.backward(dy.double())
    assert "fused" in " ".join(bn.last_kernels()["train_forward"] + bn.last_kernels()["train_backward"])
    assert_close(y, y64, dtype)
    assert_close(running_mean, ref_mean, tol=STATS_TOL)
    assert_close(running_var, ref_var, tol=STATS_TOL)
    assert_close(x.grad, leaves64[0].grad, dtype)
    assert_close(weight.grad, leaves64[1].grad, tol=STATS_TOL)
    assert_close(bias.grad, leaves64[2].grad, tol=STATS_TOL)


def test_launch_refuses_a_vector_that_does_not_divide_the_rows_and_writes_nothing():
    B, C, HW = 2, 7, 15
    x, dy, weight = randn(B, C, HW), randn(B, C, HW), randn(C)
    mean, rstd = randn(C), randn(C).abs()
    dx, dweight, dbias = poisoned(B, C, HW), poisoned(C), poisoned(C)
    misaligned = BatchNorm2dTrainBackwardFused(4, 2, 64, 4)  # rows of 3*15 elements start at odd offsets
    with pytest.raises(ValueError, match="vector"):
        misaligned.launch(dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, 3)
    too_many = BatchNorm2dTrainBackwardFused(4, 2, 64, 1)  # 5 channels of 15 exceed BLOCK_J = 64
    with pytest.raises(ValueError, match="CHANNELS"):
        too_many.launch(dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, 5)
    for out in (dx, dweight, dbias):
        assert torch.isnan(out).all()
