"""Batch norm of channels-last inputs on the channels-last kernels (`ops/batch_norm/channels_last.py`), read where
they lie: results, layouts and running statistics against torch.nn.functional.batch_norm in float64."""
import pytest
import torch
import torch.nn.functional as F

from nnkernels import tuning
from nnkernels.functional import batchnorm as bn
from nnkernels.functional import batchnorm_nhwc as nhwc
from nnkernels.functional import clear_plans, last_kernels
from nnkernels.ops.batch_norm.channels_last import (BatchNorm2dNhwcFusedForward, BatchNorm2dNhwcNormalize,
                                                    BatchNorm2dNhwcPartialStats)
from support import (BN_STATS_TOLERANCE, DEVICE, DTYPES, assert_close, batch_norm_train_ops_match, dtype_id, poisoned,
                     randn)

CL = torch.channels_last


def _channels_last(t):
    return t.contiguous(memory_format=CL)


def _many_chunks(monkeypatch):
    """Tiles of 4 rows by 8 channels aiming at 12 programs, and merges 2 partials a step: several chunks per
    channel block, several merge steps, channels and rows that do not fill their last tiles."""
    _only(monkeypatch, nhwc.NhwcConfig(4, 8, 12, 4))
    monkeypatch.setattr(nhwc, "MERGE_PARTIALS", 2)


def _only(monkeypatch, config):
    monkeypatch.setattr(nhwc, "nhwc_candidates", lambda C, machine, rows: [config])
    clear_plans()


# The split passes in one chunk, in many, and the fused single launches stepping 4 rows over 8 channels.
SPLITS = {"one chunk": lambda monkeypatch: _only(monkeypatch, nhwc.NhwcConfig(2**10, 32, 1, 4)),
          "many chunks": _many_chunks,
          "fused": lambda monkeypatch: _only(monkeypatch, nhwc.NhwcConfig(4, 8, 0, 4, True))}


def _reference(x, weight, bias, dy, training, running_mean, running_var, momentum=0.1, eps=1e-5):
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    y64 = F.batch_norm(x64, running_mean, running_var, w64, b64, training, momentum, eps)
    y64.backward(dy.double())
    return y64, x64.grad, w64.grad, b64.grad


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_channels_last_batch_norm_matches_float64(training, dtype, split, monkeypatch, poisoned_outputs):
    SPLITS[split](monkeypatch)
    B, C, H, W = 3, 20, 5, 7
    x = _channels_last((randn(B, C, H, W) * 2 + 3).to(dtype)).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    dy = _channels_last(randn(B, C, H, W, dtype=dtype))
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    mean64, var64 = running_mean.double(), running_var.double()
    y = bn.batch_norm(x, running_mean, running_var, weight, bias, training=training, momentum=0.3)
    y64, dx64, dw64, db64 = _reference(x, weight, bias, dy, training, mean64, var64, momentum=0.3)
    assert y.is_contiguous(memory_format=CL) and y.dtype == dtype
    assert_close(y, y64, dtype)
    assert_close(running_mean, mean64, tol=BN_STATS_TOLERANCE)
    assert_close(running_var, var64, tol=BN_STATS_TOLERANCE)
    y.backward(dy)
    assert_close(x.grad, dx64, dtype)
    assert_close(weight.grad, dw64, tol=BN_STATS_TOLERANCE)
    assert_close(bias.grad, db64, tol=BN_STATS_TOLERANCE)
    launched = last_kernels("batch_norm")
    mode = "train" if training else "eval"
    forward = launched[f"{mode}_forward_update" if training else "eval_forward"]
    assert all("nhwc" in k for k in forward), forward
    # The evaluation backward runs on the NCHW kernels; the training backward reads dy and x where they lie.
    assert all(("nhwc" in k) == training for k in launched[f"{mode}_backward"]), launched
    if training:
        assert x.grad.is_contiguous(memory_format=CL)
        assert len(forward) == len(launched["train_backward"]) == (1 if split == "fused" else 3)


@pytest.mark.parametrize("split", ["many chunks", "fused"])
def test_channels_last_statistics_are_stable_far_from_zero(split, monkeypatch):
    """Mean 1e4, std 1e-2 in fp32, over several chunks or in one launch: a one-pass sum of squares would lose
    every digit."""
    SPLITS[split](monkeypatch)
    B, C, H, W = 4, 10, 6, 5
    x = _channels_last(randn(B, C, H, W) * 1e-2 + 1e4)
    _, mean, rstd, var_unbiased = bn.batch_norm_train_op(x, None, None, 0.0)
    x64 = x.double()
    assert_close(mean, x64.mean((0, 2, 3)), tol=1e-7)
    assert_close(var_unbiased, x64.var((0, 2, 3), unbiased=True), tol=1e-4)
    assert_close(rstd, x64.var((0, 2, 3), unbiased=False).rsqrt(), tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_every_channels_last_candidate_is_correct(dtype, monkeypatch, gpu_lists):
    """tuning.choose forced to pick candidate i of the GPU's list after running candidate i+1 (as tuning runs
    several on the same outputs): y, the statistics, dx, dweight and dbias against float64."""
    B, C, H, W = 4, 40, 9, 11
    x = _channels_last((randn(B, C, H, W) * 2 + 3).to(dtype))
    weight, bias, dy = randn(C), randn(C), _channels_last(randn(B, C, H, W, dtype=dtype))
    zeros, ones = (torch.full((C,), v, dtype=torch.float64, device=DEVICE) for v in (0.0, 1.0))
    y64, dx64, dw64, db64 = _reference(x, weight, bias, dy, True, zeros, ones)
    candidates = nhwc.nhwc_candidates(C, gpu_lists, B * H * W)
    assert len(set(candidates)) == len(candidates) >= 4 and candidates[0].fused
    assert not any(c.fused for c in nhwc.nhwc_candidates(C, gpu_lists, nhwc.FUSED_ROWS + 1))
    launched = set()
    for index in range(len(candidates)):
        def pick(kind, key, listed, run, decode, i=index):
            assert key == (B, C, H * W, str(dtype), "nhwc") and kind.endswith("_nhwc")
            listed = listed()
            run(listed[(i + 1) % len(listed)])
            return listed[i]

        monkeypatch.setattr(tuning, "choose", pick)
        clear_plans()
        (y, dx), ids = batch_norm_train_ops_match(x, weight, bias, dy, (y64, dx64, dw64, db64), dtype)
        assert y.is_contiguous(memory_format=CL) and dx.is_contiguous(memory_format=CL)
        launched.add(ids)
    assert len(launched) >= 4, launched  # some candidates differ only in programs, which this size does not fill


@pytest.mark.parametrize("split", ["many chunks", "fused"])
def test_channels_last_batch_norm_is_bitwise_reproducible(split, monkeypatch):
    SPLITS[split](monkeypatch)
    B, C, H, W = 3, 20, 5, 7
    x = _channels_last(randn(B, C, H, W) * 2 + 3)
    dy = _channels_last(randn(B, C, H, W))
    weight, bias = randn(C), randn(C)
    runs = []
    for _ in range(2):
        y, mean, rstd, var_unbiased = bn.batch_norm_train_op(x, weight, bias, 1e-5)
        runs.append((y, mean, rstd, var_unbiased, *bn.batch_norm_train_backward_op(dy, x, weight, mean, rstd)))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_a_channels_last_dy_of_another_layout_is_read_right(monkeypatch):
    """A channels-last forward whose dy comes NCHW (another op's gradient): dx right, channels-last."""
    B, C, H, W = 2, 12, 4, 6
    x = _channels_last(randn(B, C, H, W) + 1).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    dy = randn(B, C, H, W)
    y = bn.batch_norm(x, None, None, weight, bias, training=True)
    y.backward(dy)
    _, dx64, dw64, db64 = _reference(x, weight, bias, dy, True, None, None)
    assert x.grad.is_contiguous(memory_format=CL)
    assert_close(x.grad, dx64)
    assert_close(weight.grad, dw64, tol=BN_STATS_TOLERANCE)


def test_channels_last_launches_check_sizes_and_write_nothing():
    M, C = 10, 6
    x, y = randn(M, C), poisoned(M, C)
    stats = [randn(C).abs() for _ in range(4)]  # weight, bias, mean, rstd
    kernel = BatchNorm2dNhwcNormalize(4, 8, 2)
    with pytest.raises(ValueError, match="x"):
        kernel.launch(randn(M - 1, C), y, *stats, M, C)
    with pytest.raises(ValueError, match="weight"):
        kernel.launch(x, y, randn(C + 1), *stats[1:], M, C)
    with pytest.raises(TypeError, match="mean"):
        kernel.launch(x, y, *stats[:2], stats[2].double(), stats[3], M, C)
    with pytest.raises(ValueError, match="C_ALIGN: expected a power of two dividing C = 6, got 4"):
        BatchNorm2dNhwcNormalize(4, 8, 4).launch(x, y, *stats, M, C)
    assert torch.isnan(y).all()
    partials = poisoned(3 * C * 2)
    stats_kernel = BatchNorm2dNhwcPartialStats(4, 8, 2)
    with pytest.raises(ValueError, match="ROW_STRIDE"):
        stats_kernel.launch(x, partials, M, C, 5, C)
    with pytest.raises(ValueError, match="partials"):
        stats_kernel.launch(x, partials[:-1], M, C, 5, C * 2)
    with pytest.raises(ValueError, match="ROWS_PER_CHUNK"):
        stats_kernel.launch(x, partials, M, C, 0, C * 2)
    assert torch.isnan(partials).all()
    outputs = [poisoned(C) for _ in range(3)]  # mean, rstd, var_unbiased
    fused = BatchNorm2dNhwcFusedForward(4, 8, False, 2)
    with pytest.raises(ValueError, match="y"):
        fused.launch(x, y[:-1], *stats[:2], *outputs, *outputs[:2], M, C, 1e-5, 0.1)
    with pytest.raises(ValueError, match="var_unbiased"):
        fused.launch(x, y, *stats[:2], *outputs[:2], poisoned(C - 1), *outputs[:2], M, C, 1e-5, 0.1)
    with pytest.raises(ValueError, match="eps"):
        fused.launch(x, y, *stats[:2], *outputs, *outputs[:2], M, C, -1.0, 0.1)
    assert torch.isnan(y).all() and all(torch.isnan(t).all() for t in outputs)
