"""Batch-norm kernels (training and frozen statistics) against torch.nn.functional.batch_norm in
float64: the fused one-tile kernels and the split ones (forced on tiny shapes by a small plan)."""
import functools

import pytest
import torch
import torch.nn.functional as F

from nnkernels import tuning
from nnkernels.functional import batchnorm_algorithms as algorithms
from nnkernels.functional import clear_plans, last_kernels
from nnkernels.ops.batch_norm.train import BatchNorm2dTrainNormalize
from support import (BN_STATS_TOLERANCE, DEVICE, DTYPES, GPU, assert_close, batch_norm_train_ops_match, gpu, poisoned,
                     randn)
from nnkernels.functional import batchnorm as bn


def _use_plan(kind, monkeypatch):
    """The functional module's plan: its own (fused on tiny shapes) or one cutting channels into chunks
    (the training passes take their tile and programs from `split_candidates`)."""
    if kind == "split":
        monkeypatch.setattr(algorithms, "fits_one_tile", lambda *args, **options: False)
        monkeypatch.setattr(algorithms, "tile_plan", functools.partial(algorithms.tile_plan, tile=16, programs=9,
                                                                       fused_limit=0))
        monkeypatch.setattr(algorithms, "split_candidates", lambda step, machine: [algorithms.SplitConfig(16, 9, 4)])
        clear_plans()


@pytest.fixture(params=["fused", "split"])
def plan(request, monkeypatch):
    _use_plan(request.param, monkeypatch)
    return request.param


def _reference(x, weight, bias, dy, training, running_mean, running_var, eps=1e-5):
    x64, w64, b64 = (t.detach().to(torch.float64).requires_grad_() for t in (x, weight, bias))
    y64 = F.batch_norm(x64, running_mean.double(), running_var.double(), w64, b64, training, 0.1, eps)
    y64.backward(dy.to(torch.float64))
    return y64, x64.grad, w64.grad, b64.grad


# Both plans in fp32 and bf16; fp16 (same code path as bf16) on the fused plan.
PLANS_AND_DTYPES = [("fused", d) for d in DTYPES] + [("split", torch.float32), ("split", torch.bfloat16)]


@pytest.mark.parametrize("plan, dtype", PLANS_AND_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_forward_and_backward_match_pytorch(plan, dtype, training, monkeypatch):
    _use_plan(plan, monkeypatch)
    B, C, H, W = 3, 4, 5, 6
    x = (randn(B, C, H, W) * 2 + 3).to(dtype)
    weight, bias, dy = randn(C), randn(C), randn(B, C, H, W, dtype=dtype)
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    y64, dx64, dw64, db64 = _reference(x, weight, bias, dy, training, running_mean, running_var)
    if training:
        y, mean, rstd, var_unbiased = bn.batch_norm_train_op(x, weight, bias, 1e-5)
        x64 = x.double()
        assert_close(mean, x64.mean((0, 2, 3)), tol=BN_STATS_TOLERANCE)
        assert_close(rstd, (x64.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt(), tol=BN_STATS_TOLERANCE)
        assert_close(var_unbiased, x64.var((0, 2, 3), unbiased=True), tol=BN_STATS_TOLERANCE)
        dx, dweight, dbias = bn.batch_norm_train_backward_op(dy, x, weight, mean, rstd)
        step = "train"
    else:
        y = bn.batch_norm_eval_op(x, running_mean, running_var, weight, bias, 1e-5)
        dx, dweight, dbias = bn.batch_norm_eval_backward_op(dy, x, running_mean, running_var, weight, 1e-5)
        step = "eval"
    assert_close(y, y64, dtype)
    assert_close(dx, dx64, dtype)
    assert_close(dweight, dw64, tol=BN_STATS_TOLERANCE)
    assert_close(dbias, db64, tol=BN_STATS_TOLERANCE)
    launched = " ".join(last_kernels("batch_norm")[f"{step}_forward"] + last_kernels("batch_norm")[f"{step}_backward"])
    if step == "train":
        assert ("fused" in launched) == (plan == "fused")
    else:
        assert ("sum_partials" in launched) == (plan == "split")


def test_statistics_are_stable_far_from_zero(plan):
    """Mean 1e4, std 1e-2 in fp32: a one-pass sum of squares would lose every digit of the variance."""
    B, C, H, W = 4, 2, 6, 5
    x = randn(B, C, H, W) * 1e-2 + 1e4
    _, mean, rstd, var_unbiased = bn.batch_norm_train_op(x, None, None, 0.0)
    x64 = x.double()
    assert_close(var_unbiased, x64.var((0, 2, 3), unbiased=True), tol=1e-4)
    assert_close(rstd, x64.var((0, 2, 3), unbiased=False).rsqrt(), tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_training_updates_running_stats_once_in_its_forward(plan, dtype):
    """batch_norm in training with running statistics: y, the gradients and the updated statistics (the
    unbiased variance, momentum 0.3) against float64; both plans launch no kernel of their own for the update."""
    B, C, H, W = 3, 4, 5, 6
    x = (randn(B, C, H, W) * 2 + 3).to(dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    mean64, var64 = running_mean.double(), running_var.double()
    y = bn.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.3)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    y64 = F.batch_norm(x64, mean64, var64, w64, b64, training=True, momentum=0.3)
    assert_close(running_mean, mean64, tol=BN_STATS_TOLERANCE)
    assert_close(running_var, var64, tol=BN_STATS_TOLERANCE)
    assert_close(y, y64, dtype)
    dy = randn(B, C, H, W, dtype=dtype)
    y.backward(dy)
    y64.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype)
    assert_close(weight.grad, w64.grad, tol=BN_STATS_TOLERANCE)
    assert_close(bias.grad, b64.grad, tol=BN_STATS_TOLERANCE)
    forward = last_kernels("batch_norm")["train_forward_update"]
    assert len(forward) == (1 if plan == "fused" else 2), forward


def test_normalize_launch_checks_sizes_and_writes_nothing():
    B, C, HW = 2, 3, 8
    x = randn(B, C, HW)
    y = poisoned(B, C, HW)
    stats = [randn(C).abs() for _ in range(5)]  # mean, rstd, var_unbiased, running_mean, running_var
    partials = randn(3 * C * 2).abs()  # three rows of C * 2 partials
    kernel = BatchNorm2dTrainNormalize(1, 8, 2, True)
    with pytest.raises(ValueError, match="NUM_PARTIALS"):
        kernel.launch(x, y, randn(C), randn(C), randn(3 * C * 4), *stats, B, C, HW, 4, 1, C * 4, 1e-5, 0.1)
    with pytest.raises(ValueError, match="ROW_STRIDE"):
        kernel.launch(x, y, randn(C), randn(C), partials, *stats, B, C, HW, 2, 1, C, 1e-5, 0.1)
    with pytest.raises(ValueError, match="partials"):
        kernel.launch(x, y, randn(C), randn(C), partials[:-1], *stats, B, C, HW, 2, 1, C * 2, 1e-5, 0.1)
    with pytest.raises(ValueError, match="weight"):
        kernel.launch(x, y, randn(C + 1), randn(C), partials, *stats, B, C, HW, 2, 1, C * 2, 1e-5, 0.1)
    with pytest.raises(ValueError, match="running_var"):
        kernel.launch(x, y, randn(C), randn(C), partials, *stats[:4], randn(C + 1), B, C, HW, 2, 1, C * 2, 1e-5, 0.1)
    with pytest.raises(TypeError, match="partials"):
        kernel.launch(x, y, randn(C), randn(C), partials.double(), *stats, B, C, HW, 2, 1, C * 2, 1e-5, 0.1)
    assert torch.isnan(y).all()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kernels_on_gpu_are_deterministic_and_correct(dtype):
    """B16 C8 56x56 takes the split kernels with many chunks: bitwise equal twice, and right."""
    B, C, H, W = 16, 8, 56, 56
    assert not algorithms.tile_plan(B, C, H * W, GPU).fused
    x = torch.randn(B, C, H, W, device=DEVICE).to(dtype) + 2
    dy = torch.randn(B, C, H, W, device=DEVICE).to(dtype)
    weight, bias = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    runs = []
    for _ in range(2):
        y, mean, rstd, var_unbiased = bn.batch_norm_train_op(x, weight, bias, 1e-5)
        runs.append((y, mean, rstd, var_unbiased, *bn.batch_norm_train_backward_op(dy, x, weight, mean, rstd),
                     *bn.batch_norm_eval_backward_op(dy, x, mean, rstd, weight, 1e-5)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    zeros, ones = torch.zeros(C, device=DEVICE), torch.ones(C, device=DEVICE)
    y64, dx64, dw64, db64 = _reference(x, weight, bias, dy, True, zeros, ones)
    y, _, _, _, dx, dweight, dbias = runs[0][:7]
    assert_close(y, y64, dtype)
    assert_close(dx, dx64, dtype)
    assert_close(dweight, dw64, tol=BN_STATS_TOLERANCE)
    assert_close(dbias, db64, tol=BN_STATS_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_every_split_candidate_is_correct(dtype, monkeypatch, gpu_lists):
    """tuning.choose forced to pick candidate i of the GPU's split training candidates, after running
    candidate i+1 (as tuning runs several on the same outputs): y, the statistics, dx, dweight and dbias
    against float64. The shape is cut into tiles of 2 to 8 images, so the candidates launch different kernels
    (some only differ in programs, which these few tiles do not fill)."""
    monkeypatch.setattr(algorithms, "fits_one_tile", lambda *args, **options: False)
    B, C, H, W = 16, 3, 32, 32
    x = (randn(B, C, H, W) * 2 + 3).to(dtype)
    weight, bias, dy = randn(C), randn(C), randn(B, C, H, W, dtype=dtype)
    zeros, ones = torch.zeros(C, device=DEVICE), torch.ones(C, device=DEVICE)
    y64, dx64, dw64, db64 = _reference(x, weight, bias, dy, True, zeros, ones)
    for step in ("train_forward", "train_backward"):
        candidates = algorithms.split_candidates(step, GPU)
        assert len(set(candidates)) == len(candidates) >= 4
    launched = set()
    for index in range(max(len(shapes) for shapes in algorithms.SPLIT_SHAPES.values())):
        def pick(kind, key, candidates, run, decode, i=index):
            assert key == (B, C, H * W, str(dtype))
            listed = candidates()
            run(listed[(i + 1) % len(listed)])
            return listed[i % len(listed)]

        monkeypatch.setattr(tuning, "choose", pick)
        clear_plans()
        launched.add(batch_norm_train_ops_match(x, weight, bias, dy, (y64, dx64, dw64, db64), dtype)[1])
    assert len(launched) >= 4, launched
