"""Batch norm on small spatial sizes: the fused kernels that take several channels per program as one
[batch, CHANNELS*HW] tile (training forward and backward, frozen-statistics forward and backward),
against torch.nn.functional.batch_norm in float64, on poisoned outputs; and every config that tuning
may pick for them (`grouped_candidates`)."""
import functools

import pytest
import torch
import torch.nn.functional as F

from nnkernels import machine, tuning
from nnkernels.functional import batch_norm, clear_plans, last_kernels
from nnkernels.functional import batchnorm_algorithms as algorithms
from nnkernels.machine import Machine
from nnkernels.ops.batch_norm.eval import BatchNorm2dEvalBackwardGrouped, BatchNorm2dEvalForwardGrouped
from nnkernels.ops.batch_norm.train import BatchNorm2dTrainBackwardFused, BatchNorm2dTrainForwardFused
from support import DTYPES, GPU, INTERPRETED, assert_close, dtype_id, force_choice, poisoned, randn

STATS_TOL = 2e-5  # fp32 per-channel results, as in test_batch_norm_train


def test_plan_for_b32_c2048_7x7_loads_aligned_rows_of_several_channels():
    """The GPU plan of the benchmark's 7x7 layer: 4 channels (196 contiguous elements per image, 16-byte
    aligned in fp32, 8-byte in bf16) per program, 512 programs of one [32, 256] tile."""
    for element_size, vector in ((4, 4), (2, 4)):
        channels = algorithms.fused_channels(32, 2048, 49, element_size, algorithms.GROUPED_TILE,
                                             algorithms.GROUPED_PROGRAMS_PER_SM * GPU.sms)
        assert channels == 4
        assert algorithms.group_vector(2048, 49, channels, element_size) == vector
        assert algorithms.tile_plan(32, 2048, 49, GPU, element_size=element_size).channels == 4
    # 7 channels per program would use more lanes (343 of 512) but only 4-byte rows: 4 wins.
    assert algorithms.group_vector(2048, 49, 7, 4) == 1


def _kernels(dtype, B, C, HW, channels):
    plan = algorithms.tile_plan(B, C, HW, GPU if not INTERPRETED else machine.INTERPRETER,
                                element_size=dtype.itemsize, channels=channels)
    assert plan.fused and plan.channels == channels
    grouped = (plan.block_c, plan.block_b, plan.block_j, plan.vector)
    train = [BatchNorm2dTrainForwardFused(*grouped, True, dtype=dtype),  # updating the running statistics
             BatchNorm2dTrainBackwardFused(*grouped, dtype=dtype)]
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
    new_mean, new_var = running_mean.clone(), running_var.clone()  # updated in place
    train_forward.launch(x, y, weight, bias, mean, rstd, var_unbiased, new_mean, new_var, new_mean, new_var,
                         B, C, HW, channels, 1e-5, 0.3)
    train_backward.launch(dy, x, dx, weight, mean, rstd, dweight, dbias, B, C, HW, channels)
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    y64 = F.batch_norm(x64, None, None, w64, b64, True, 0.1, 1e-5)
    y64.backward(dy64)
    assert_close(y, y64, dtype)
    assert_close(mean, x64.detach().mean((0, 2, 3)), tol=STATS_TOL)
    assert_close(rstd, (x64.detach().var((0, 2, 3), unbiased=False) + 1e-5).rsqrt(), tol=STATS_TOL)
    assert_close(var_unbiased, x64.detach().var((0, 2, 3), unbiased=True), tol=STATS_TOL)
    expected_mean, expected_var = running_mean.double(), running_var.double()
    F.batch_norm(x64.detach(), expected_mean, expected_var, training=True, momentum=0.3)
    assert_close(new_mean, expected_mean, tol=STATS_TOL)
    assert_close(new_var, expected_var, tol=STATS_TOL)
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
    """nnkernels.batch_norm with 4 channels per program over C = 10 (the last program holds 2), 7x7: the plan's
    first guess, which tuning would otherwise replace on the GPU."""
    monkeypatch.setattr(algorithms, "tile_plan", functools.partial(algorithms.tile_plan, channels=4))
    force_choice(monkeypatch, 0)
    B, C, H, W = 2, 10, 7, 7
    x = (randn(B, C, H, W) - 1).to(dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    dy = randn(B, C, H, W, dtype=dtype)
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    ref_mean, ref_var = running_mean.double(), running_var.double()
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y = batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.3)
    y.backward(dy)
    y64 = F.batch_norm(leaves64[0], ref_mean, ref_var, *leaves64[1:], training=True, momentum=0.3)
    y64.backward(dy.double())
    launched = last_kernels("batch_norm")
    assert all("fused" in ids[0] and "__4__" in ids[0] for ids in (launched["train_forward_update"],
                                                                  launched["train_backward"]))
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


def test_candidates_for_b32_c2048_7x7_are_tiles_of_4k_8k_16k_and_the_training_forward_starts_with_fewer_warps():
    """The heuristic first, then 2, 4, 8 channels per program (rows of 98, 196, 392 elements); for the
    training forward 4K and 8K-element tiles at 1 and 2 warps come second."""
    for element_size in (4, 2):
        candidates = algorithms.grouped_candidates(32, 2048, 49, element_size, GPU)
        assert [(c.channels, c.num_warps) for c in candidates] == [(4, 8), (2, 4), (8, 8), (4, 4), (2, 8), (8, 4)]
        assert [(c.block_b, c.block_j) for c in candidates[:3]] == [(32, 256), (32, 128), (32, 512)]
        forward = algorithms.grouped_candidates(32, 2048, 49, element_size, GPU, step="train_forward")
        assert [(c.channels, c.num_warps) for c in forward] == [(4, 8), (2, 1), (4, 2), (2, 4), (8, 8), (4, 4)]
    for B, C, HW in ((32, 512, 49), (32, 1024, 196), (8, 512, 16), (3, 7, 15)):
        for step in ("train_forward", "eval_backward"):
            candidates = algorithms.grouped_candidates(B, C, HW, 4, GPU, step=step)
            assert 1 <= len(candidates) <= algorithms.MOST_GROUPED_CANDIDATES == 6
            assert len(set(candidates)) == len(candidates)
            assert all(c.block_b >= B and c.block_j >= c.channels * HW for c in candidates)
            assert all(c.block_b * c.block_j <= 32 * c.num_warps * algorithms.MOST_ELEMENTS_PER_THREAD
                       for c in candidates)


# (B, C, H, W, tile shapes, min programs): on the CPU, tiles scaled down so that a tiny shape gets 2, 4 and 8
# channels per program (C = 10: the last program of 4 or 8 holds 2 channels), besides the interpreter's
# heuristic (all channels in one program); on the GPU the library's own shapes, the training forward's
# first, over 36 channels of 7x7, for every step.
CPU_CASE = (3, 10, 2, 3, ((96, 8), (48, 4), (192, 8), (96, 4), (48, 8), (192, 4), (24, 4)), 1)
GPU_CASE = (32, 36, 7, 7, algorithms.GROUPED_FORWARD_SHAPES + algorithms.GROUPED_SHAPES, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_every_candidate_config_is_correct_and_leaves_running_stats_updated_once(dtype, monkeypatch):
    """tuning.choose forced to pick candidate i of every grouped launch, after running candidate i+1 (as
    tuning runs several on the same outputs): values and gradients against float64, running statistics
    updated exactly once, the kernel launched the one candidate i describes, and the tuning key names the
    shape and dtype."""
    B, C, H, W, shapes, min_programs = CPU_CASE if INTERPRETED else GPU_CASE
    HW = H * W
    # The GPU's candidate lists, on a machine of `min_programs` SMs, with the tile shapes above for every step.
    tested = Machine(gpu=True, sms=min_programs, tma=True, name="test GPU")
    monkeypatch.setattr(machine, "machine_of", lambda device: tested)
    monkeypatch.setattr(algorithms, "GROUPED_SHAPES", shapes)
    monkeypatch.setattr(algorithms, "GROUPED_FORWARD_SHAPES", ())
    x = (randn(B, C, H, W) * 2 + 3).to(dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    dy = randn(B, C, H, W, dtype=dtype)
    stats = randn(C), randn(C).abs() + 0.5
    references = {}
    for training in (True, False):
        leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
        stats64 = [t.double() for t in stats]
        y64 = F.batch_norm(leaves64[0], *stats64, *leaves64[1:], training=training, momentum=0.3)
        y64.backward(dy.double())
        references[training] = (y64, *(t.grad for t in leaves64), *stats64)
    first = algorithms.grouped_candidates(B, C, HW, dtype.itemsize, tested)
    # several channel counts, one of which leaves the last program ragged
    assert len({c.channels for c in first}) >= 3 and any(C % c.channels for c in first), first
    seen = {}
    for index in range(len(first)):
        def pick(kind, key, candidates, run, decode, i=index):
            listed = candidates()
            assert listed == first
            seen[kind] = key
            run(listed[(i + 1) % len(listed)])
            return listed[i]

        monkeypatch.setattr(tuning, "choose", pick)
        clear_plans()
        for training in (True, False):
            for t in (x, weight, bias):
                t.grad = None
            running_mean, running_var = (t.clone() for t in stats)
            y = batch_norm(x, running_mean, running_var, weight, bias, training=training, momentum=0.3)
            y.backward(dy)
            y64, dx64, dweight64, dbias64, mean64, var64 = references[training]
            mode = "train" if training else "eval"
            for name, ours, reference, tol in (
                    ("y", y, y64, None), ("dx", x.grad, dx64, None), ("dweight", weight.grad, dweight64, STATS_TOL),
                    ("dbias", bias.grad, dbias64, STATS_TOL), ("running_mean", running_mean, mean64, STATS_TOL),
                    ("running_var", running_var, var64, STATS_TOL)):
                try:
                    assert_close(ours, reference, dtype, tol=tol)
                except AssertionError as error:
                    raise AssertionError(f"candidate {index} {first[index]}, {mode} {name}: {error}") from None
            chosen = first[index]
            for step in ("train_forward_update" if training else "eval_forward", f"{mode}_backward"):
                (launched,) = last_kernels("batch_norm")[step]
                assert f"__{chosen.block_b}__{chosen.block_j}__" in launched and f"__w{chosen.num_warps}__" in launched
    steps = ("train_forward", "train_backward", "eval_forward", "eval_backward")
    assert seen == {f"batch_norm_{step}_grouped": (B, C, HW, str(dtype)) for step in steps}
