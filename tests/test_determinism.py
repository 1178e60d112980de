"""Determinism: every kernel the functional ops choose gives bitwise-identical results run to run.

Each case runs one functional op forward and backward three times on the same inputs (the first
call also picks and tunes the kernels) and requires every output and gradient to be bitwise equal
across the runs. The kernels each run launches are read from the "nnkernels" debug log; a case
must launch the kernels it names (so every path is really taken: split and fused batch norm, the
multi-chunk eval reduction, the split weight gradient), and `test_cases_cover_every_kernel_the_ops_choose`
checks, without a GPU, that together the cases name every kernel class the functional ops list.

The seed kernels (Conv2dBackward, Avgpool2dBackward scatter with atomics, so their fp additions
land in a run-dependent order) are non-deterministic by design and excluded: the functional ops
never choose them, which every case checks too.

On the GPU the cases use shapes that take the GPU's plans (`gpu`). On the CPU the same code runs
on tiny shapes (`cpu`) of one case per op, as a dry run of this file's logic: the interpreter runs
programs one by one, so there it proves the harness, not the kernels.
"""
import contextlib
import logging
import os
import re
from dataclasses import dataclass, field

import pytest
import torch
from support import DEVICE, INTERPRETED, gpu

from nnkernels import tuning
from nnkernels.functional import avg_pool2d, batch_norm, clear_plans, conv2d
from nnkernels.functional.common import KERNELS
from nnkernels.kernel import catalogue

RUNS = 3
CLASSES = {cls.__name__: cls for cls in catalogue()}
# SyncBatchNorm's merges run only across ranks, in a fixed order: tests/test_sync_batch_norm.py.
OP_KERNELS = {op: classes for op, classes in KERNELS.items() if op != "sync_batch_norm"}


@dataclass
class Case:
    op: str
    gpu: dict  # keyword arguments of `make_inputs` on the GPU
    cpu: dict  # and for the CPU dry run
    expects: tuple  # kernel class names a GPU run must launch
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    tf32: bool = True  # torch.backends.cudnn.allow_tf32 during the runs
    tuned: bool = True  # False: NNKERNELS_TUNE=off, the heuristic's first guess (a path tuning might not take)
    channels_last: bool = False  # x stored NHWC


CONV_NCHW = ("Conv2dGemmForward", "Conv2dGemmDx", "Conv2dGemmDw", "Conv2dDwReduce")
CONV_CL_TMA = ("ChannelsLastCopyPair", "ChannelsLastCopy", "Conv2dGemmClForward", "Conv2dTmaDw",
               "Conv2dDwReduce")  # dx: the forward kernel
CONV_GROUPED = ("ChannelsLastCopy", "Conv2dGroupedWeight", "Conv2dGemmClForward", "Conv2dGemmClDw",
                "Conv2dDwReduce")  # dx: the forward kernel
CONV_GROUPED_STRIDED = ("ChannelsLastCopy", "Conv2dGroupedWeight", "Conv2dGemmClForward", "Conv2dGemmClDx",
                        "Conv2dGemmClDw", "Conv2dDwReduce")
CONV_DEPTHWISE = ("Conv2dDepthwiseForward", "Conv2dDepthwiseDx", "Conv2dDepthwiseDw", "Conv2dDwReduce")
CONV_DEPTHWISE_CL = ("Conv2dDepthwiseClForward", "Conv2dDepthwiseClDx", "Conv2dDepthwiseClDw", "Conv2dDwReduce")
BN_FUSED = ("BatchNorm2dTrainForwardFused", "BatchNorm2dTrainBackwardFused")  # the forward updates the running stats
BN_SPLIT = ("BatchNorm2dPartialStats", "BatchNorm2dTrainNormalize", "BatchNorm2dPartialGradSums",
            "BatchNorm2dTrainBackwardDx")
BN_NHWC = ("BatchNorm2dNhwcPartialStats", "BatchNorm2dNhwcMergeStats", "BatchNorm2dNhwcNormalize",
           "BatchNorm2dNhwcPartialGradSums", "BatchNorm2dNhwcMergeGradSums", "BatchNorm2dNhwcBackwardDx")

CASES = {
    # conv2d: implicit GEMM on channels-last copies (dx whenever C_OUT is a multiple of 16: at stride 1 as the
    # forward kernel on dy; strided, written channels-last and transposed; grouped, on block-diagonal weights), on
    # NCHW (channels not multiples of 16), 1x1 as a matrix product (strided: of the subsampled input; the first
    # guess, as tuning may take the channels-last kernels instead), depthwise, the forward a row per
    # program and the backward as 1x1 products of the unfolded input (at most 4 input channels, large planes); dw
    # split into fp32 partials (from TMA boxes; in fp32 on small planes, one 1x1 product of the input unfolded
    # rows-outer); on small planes the forward (and dx) from TMA boxes too.
    "conv2d-cl-fp32": Case("conv2d", dict(x=(8, 32, 28, 28), w=(64, 32, 3, 3)), dict(x=(1, 16, 4, 4), w=(16, 16, 3, 3)),
                           CONV_CL_TMA, dict(padding=1, bias=True)),
    "conv2d-1x1-strided-fp16": Case("conv2d", dict(x=(16, 64, 56, 56), w=(128, 64, 1, 1)),
                                    dict(x=(1, 16, 4, 4), w=(16, 16, 1, 1)),
                                    ("Subsample2dForward", "Conv2dPointwise", "Subsample2dBackward",
                                     "Conv2dPointwiseDw", "Conv2dDwReduce"),
                                    dict(stride=2), torch.float16, tuned=False),
    # Strided, in 16-channel runs: every pass from TMA boxes (the first guesses; dx written channels-last).
    "conv2d-cl-strided-tma-bf16": Case("conv2d", dict(x=(8, 32, 28, 28), w=(64, 32, 3, 3)),
                                       dict(x=(1, 16, 5, 5), w=(16, 16, 3, 3)),
                                       ("ChannelsLastCopyPair", "ChannelsLastCopy", "Conv2dTmaForward", "Conv2dTmaDx",
                                        "Conv2dTmaDw", "Conv2dDwReduce"),
                                       dict(stride=2, padding=1), torch.bfloat16, tuned=False),
    "conv2d-pointwise-bf16": Case("conv2d", dict(x=(16, 64, 28, 28), w=(128, 64, 1, 1)),
                                  dict(x=(2, 24, 5, 7), w=(40, 24, 1, 1)),
                                  ("Conv2dPointwise", "Conv2dPointwiseDw", "Conv2dDwReduce"),
                                  dict(bias=True), torch.bfloat16, tuned=False),
    "conv2d-nchw-fp32": Case("conv2d", dict(x=(8, 24, 28, 28), w=(40, 24, 3, 3)), dict(x=(2, 3, 5, 5), w=(4, 3, 3, 3)),
                             CONV_NCHW, dict(padding=1, bias=True)),
    "conv2d-unfolded-bf16": Case("conv2d", dict(x=(8, 3, 64, 64), w=(32, 3, 7, 7)),
                                 dict(x=(1, 3, 9, 9), w=(8, 3, 7, 7)),
                                 ("Conv2dRowsForward", "Conv2dPointwiseFp32Out", "Fold2d", "Unfold2d",
                                  "Conv2dPointwiseDw", "Conv2dDwReduce"),
                                 dict(stride=2, padding=3, bias=True), torch.bfloat16),
    "conv2d-rows-outer-dw-fp32": Case("conv2d", dict(x=(16, 128, 7, 7), w=(128, 128, 3, 3)),
                                      dict(x=(2, 16, 5, 5), w=(16, 16, 3, 3)),
                                      ("ChannelsLastCopyPair", "Conv2dTmaForward", "Unfold2d", "Conv2dPointwiseDw",
                                       "Conv2dDwReduce"), dict(padding=1, bias=True)),
    # Winograd F(2x2, 3x3): full fp32 (TF32 off), 3x3 stride 1, at least 64 channels; the first guess on 28x28.
    "conv2d-winograd-fp32": Case("conv2d", dict(x=(8, 64, 28, 28), w=(64, 64, 3, 3)),
                                 dict(x=(1, 16, 4, 4), w=(16, 16, 3, 3)),
                                 ("Conv2dWinogradWeight", "Conv2dWinogradInput", "Conv2dWinogradProducts",
                                  "Conv2dWinogradOutput", "Conv2dWinogradDy", "Conv2dWinogradDwFinish"),
                                 dict(padding=1, bias=True), tf32=False, tuned=False),
    "conv2d-grouped-dilated-bf16": Case("conv2d", dict(x=(4, 48, 20, 20), w=(96, 12, 3, 3)),
                                        dict(x=(1, 8, 6, 6), w=(8, 2, 3, 3)), CONV_GROUPED,
                                        dict(padding=2, dilation=2, groups=4, bias=True), torch.bfloat16),
    "conv2d-grouped-strided": Case("conv2d", dict(x=(8, 128, 14, 14), w=(128, 4, 3, 3)),
                                   dict(x=(1, 16, 6, 6), w=(16, 4, 3, 3)), CONV_GROUPED_STRIDED,
                                   dict(padding=1, stride=2, groups=32)),
    "conv2d-nchw-dilated-bf16": Case("conv2d", dict(x=(4, 24, 20, 20), w=(40, 24, 3, 3)),
                                     dict(x=(1, 4, 6, 6), w=(4, 4, 3, 3)), CONV_NCHW,
                                     dict(padding=2, dilation=2, bias=True), torch.bfloat16),
    "conv2d-depthwise": Case("conv2d", dict(x=(8, 64, 28, 28), w=(64, 1, 3, 3)), dict(x=(2, 3, 5, 5), w=(3, 1, 3, 3)),
                             CONV_DEPTHWISE, dict(padding=1, groups="C", bias=True)),
    "conv2d-depthwise-bf16": Case("conv2d", dict(x=(32, 32, 56, 56), w=(32, 1, 5, 5)),
                                  dict(x=(2, 3, 5, 5), w=(3, 1, 5, 5)), CONV_DEPTHWISE,
                                  dict(padding=2, stride=2, groups="C"), torch.bfloat16),
    # depthwise on channels-last x: the first guess, its own kernels (tuning may take the NCHW ones behind copies).
    "conv2d-depthwise-channels-last-bf16": Case("conv2d", dict(x=(32, 144, 28, 28), w=(144, 1, 3, 3)),
                                                dict(x=(2, 16, 5, 5), w=(16, 1, 3, 3)), CONV_DEPTHWISE_CL,
                                                dict(padding=1, groups="C", bias=True), torch.bfloat16,
                                                tuned=False, channels_last=True),
    # avg_pool2d: gather backward (no atomics); the lanes kernels where rows split into aligned groups.
    "avg_pool2d": Case("avg_pool2d", dict(x=(32, 64, 56, 56)), dict(x=(2, 3, 6, 6)),
                       ("AvgPool2dLanesForward", "AvgPool2dGatherBackward"),
                       dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    "avg_pool2d-lanes-bf16": Case("avg_pool2d", dict(x=(32, 64, 56, 56)), dict(x=(1, 2, 8, 8)),
                                  ("AvgPool2dLanesForward", "AvgPool2dLanesBackward"),
                                  dict(kernel_size=3, stride=1, padding=1), torch.bfloat16),
    "avg_pool2d-bf16-overlapping": Case("avg_pool2d", dict(x=(16, 32, 33, 31)), dict(x=(1, 2, 7, 5)),
                                        ("AvgPool2dGatherForward", "AvgPool2dGatherBackward"),
                                        dict(kernel_size=(3, 2), stride=1, padding=1), torch.bfloat16),
    "avg_pool2d-channels-last-bf16": Case("avg_pool2d", dict(x=(32, 64, 56, 56)), dict(x=(1, 16, 6, 5)),
                                          ("AvgPool2dClForward", "AvgPool2dClBackward"),
                                          dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
                                          torch.bfloat16, channels_last=True),
    # batch_norm: channels that fit one tile (fused and grouped kernels) and split into chunks (partials in a
    # fixed order).
    "batch_norm-train-fused": Case("batch_norm", dict(x=(4, 64, 16, 16)), dict(x=(2, 3, 4, 4)), BN_FUSED,
                                   dict(training=True)),
    "batch_norm-train-split": Case("batch_norm", dict(x=(32, 16, 32, 32)), dict(x=(2, 3, 4, 4)), BN_SPLIT,
                                   dict(training=True)),
    "batch_norm-train-split-bf16": Case("batch_norm", dict(x=(64, 8, 56, 56)), dict(x=(2, 3, 4, 4)), BN_SPLIT,
                                        dict(training=True), torch.bfloat16),
    "batch_norm-eval-grouped": Case("batch_norm", dict(x=(4, 64, 16, 16)), dict(x=(2, 3, 4, 4)),
                                    ("BatchNorm2dEvalForwardGrouped", "BatchNorm2dEvalBackwardGrouped"),
                                    dict(training=False)),
    "batch_norm-eval-chunks": Case("batch_norm", dict(x=(32, 16, 32, 32)), dict(x=(2, 3, 4, 4)),
                                   ("BatchNorm2dEvalForward", "BatchNorm2dEvalBackward", "BatchNorm2dSumPartials"),
                                   dict(training=False), torch.float16),
    # batch_norm on channels-last inputs: the NHWC kernels (the evaluation backward: the NCHW ones).
    "batch_norm-train-nhwc-bf16": Case("batch_norm", dict(x=(32, 64, 28, 28)), dict(x=(2, 5, 3, 4)), BN_NHWC,
                                       dict(training=True), torch.bfloat16, channels_last=True),
    "batch_norm-train-nhwc-fused": Case("batch_norm", dict(x=(32, 256, 7, 7)), dict(x=(2, 5, 3, 4)),
                                        ("BatchNorm2dNhwcFusedForward", "BatchNorm2dNhwcFusedBackward"),
                                        dict(training=True), torch.bfloat16, tuned=False, channels_last=True),
    "batch_norm-eval-nhwc": Case("batch_norm", dict(x=(32, 64, 28, 28)), dict(x=(2, 5, 3, 4)),
                                 ("BatchNorm2dNhwcEvalForward", "BatchNorm2dEvalBackward"), dict(training=False),
                                 channels_last=True),
}


def make_inputs(case, sizes):
    """Leaves (x and parameters, in case.dtype; batch-norm parameters fp32) from a fixed seed."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=case.dtype):
        return torch.randn(shape, generator=generator).to(device=DEVICE, dtype=dtype).requires_grad_()

    x = rand(*sizes["x"])
    if case.channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    if case.op == "conv2d":
        return [x, rand(*sizes["w"])] + ([rand(sizes["w"][0])] if case.options.get("bias") else [])
    if case.op == "batch_norm":
        return [x, rand(x.shape[1], dtype=torch.float32), rand(x.shape[1], dtype=torch.float32)]
    return [x]


def run_once(case, leaves, dy_seed=1):
    """One forward and backward on fresh copies of the running statistics; returns every output and gradient."""
    for leaf in leaves:
        leaf.grad = None
    x = leaves[0]
    if case.op == "conv2d":
        options = {k: v for k, v in case.options.items() if k != "bias"}
        if options.get("groups") == "C":
            options["groups"] = x.shape[1]
        bias = leaves[2] if len(leaves) > 2 else None
        y = conv2d(x, leaves[1], bias, **options)
        extra = []
    elif case.op == "avg_pool2d":
        y = avg_pool2d(x, **case.options)
        extra = []
    else:
        C = x.shape[1]
        running_mean = torch.linspace(-1, 1, C, device=DEVICE)
        running_var = torch.linspace(0.5, 2, C, device=DEVICE)
        y = batch_norm(x, running_mean, running_var, leaves[1], leaves[2], momentum=0.1, eps=1e-5, **case.options)
        extra = [running_mean, running_var]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(device=DEVICE, dtype=y.dtype)
    y.backward(dy)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return [y.detach()] + [leaf.grad for leaf in leaves] + extra


def launched_classes(records):
    """Kernel class names whose ids (`<function name>__<dtype>__...`) appear in the log records."""
    text = "\n".join(record.getMessage() for record in records)
    return {name for name, cls in CLASSES.items() if re.search(rf"(?<![a-z0-9_]){cls.name}__", text)}


@contextlib.contextmanager
def case_settings(case):
    """TF32 and tuning as `case` asks, restored after."""
    saved_tf32, saved_tune = torch.backends.cudnn.allow_tf32, os.environ.get("NNKERNELS_TUNE")
    torch.backends.cudnn.allow_tf32 = case.tf32
    if not case.tuned:
        os.environ["NNKERNELS_TUNE"] = "off"
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved_tf32
        if saved_tune is None:
            os.environ.pop("NNKERNELS_TUNE", None)
        else:
            os.environ["NNKERNELS_TUNE"] = saved_tune


def check_case(case, sizes, caplog, expect_kernels):
    leaves = make_inputs(case, sizes)
    runs = []
    with caplog.at_level(logging.DEBUG, logger="nnkernels"), case_settings(case):
        for _ in range(RUNS if expect_kernels else 2):
            runs.append(run_once(case, leaves))
    launched = launched_classes(caplog.records)
    seeds = {name for name in launched if CLASSES[name].seed}
    assert not seeds, f"the functional op chose seed (atomic) kernels {seeds}"
    allowed = {cls.__name__ for cls in OP_KERNELS[case.op]}
    assert launched and launched <= allowed, f"launched {launched}; {case.op} lists {allowed}"
    if expect_kernels:
        missing = set(case.expects) - launched
        assert not missing, f"case did not take its path: {missing} not launched (launched {sorted(launched)})"
    assert_runs_equal(runs, len(leaves))


def assert_runs_equal(runs, leaves, label=""):
    """Every output and gradient of `runs` (run_once's lists, `leaves` gradients each) equal to the first's."""
    names = ["y"] + [f"grad{i}" for i in range(leaves)] + ["running_mean", "running_var"]
    for run in runs[1:]:
        for name, first, again in zip(names, runs[0], run):
            assert first is not None and again is not None, f"{name}: missing"
            assert torch.equal(first, again), (
                f"{label}{name}: run-to-run difference, max |diff| {(first.float() - again.float()).abs().max().item()}"
            )


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_backward_is_bitwise_deterministic(name, caplog):
    case = CASES[name]
    check_case(case, case.gpu, caplog, expect_kernels=True)


@pytest.mark.skipif(not INTERPRETED, reason="the dry run on tiny shapes is for the CPU; the GPU runs the cases above")
@pytest.mark.parametrize("name", ["conv2d-nchw-fp32", "avg_pool2d", "batch_norm-train-fused",
                                  "batch_norm-eval-grouped"])
def test_dry_run_on_the_cpu(name, caplog):
    case = CASES[name]
    check_case(case, case.cpu, caplog, expect_kernels=False)


def test_cases_cover_every_kernel_the_ops_choose():
    chosen = {cls.__name__ for classes in OP_KERNELS.values() for cls in classes}
    named = {name for case in CASES.values() for name in case.expects}
    assert named == chosen, f"kernels no case takes: {chosen - named}; names no op lists: {named - chosen}"
    assert not any(CLASSES[name].seed for name in chosen)


DW_KIND = "conv2d_dw"
# Depthwise dw takes its one tile from a heuristic: nothing to force.
BIAS_CONV_CASES = [name for name, case in CASES.items()
                   if case.op == "conv2d" and case.options.get("bias") and case.options.get("groups") != "C"]


@pytest.mark.parametrize("name", BIAS_CONV_CASES)
def test_every_dw_candidate_repeats(name, monkeypatch):
    """Each config tuning may pick for the case's weight gradient (with the bias sums), forced in turn:
    RUNS backward passes, bitwise equal. Tuning picks one config per process, so the case tests above
    see one; a config whose pipelined loop raced (the 1x1 dw's 128 x 128 tiles with bias, Triton 3.6 on
    the H200: `ops.common.tensor_core.sums_beside_dot`) passed them whenever tuning chose another."""
    if INTERPRETED and name != "conv2d-rows-outer-dw-fp32":
        pytest.skip("the interpreter runs one case, as a dry run of the harness; the GPU runs them all")
    case = CASES[name]
    leaves = make_inputs(case, case.cpu if INTERPRETED else case.gpu)
    listed, forced = [], []
    choose = tuning.choose

    def forcing_choose(kind, key, candidates, run, decode):
        if kind == DW_KIND:
            listed[:] = listed or candidates()
            if forced:
                return forced[0]
        return choose(kind, key, candidates, run, decode)

    monkeypatch.setattr(tuning, "choose", forcing_choose)
    with case_settings(case):
        run_once(case, leaves)
        assert listed, "tuning was never asked for the weight gradient"
        for choice in list(listed):
            forced[:] = [choice]
            clear_plans()
            assert_runs_equal([run_once(case, leaves) for _ in range(RUNS)], len(leaves), f"{choice}: ")
