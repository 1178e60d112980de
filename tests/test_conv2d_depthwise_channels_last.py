"""Depthwise convolution on channels-last tensors: the channels-last kernels launched directly (outputs poisoned,
tiles that divide neither the pixels nor the channels), and `conv2d` on channels-last tensors, which reads and
writes them where they lie, with tuning offered both these kernels and the NCHW ones behind layout copies.

References: torch's grouped convolution (groups = C) and its autograd in float64 on the same data.
"""
import pytest
import torch

from nnkernels import tuning
from nnkernels.functional.common import last_kernels
from nnkernels.functional.conv import conv2d, kernels_for
from nnkernels.ops.common.host_math import channel_alignment
from nnkernels.ops.conv2d.depthwise_cl import Conv2dDepthwiseClDw, Conv2dDepthwiseClDx, Conv2dDepthwiseClForward
from nnkernels.ops.conv2d.partials import dw_partial_size
from support import (DTYPES, GPU, assert_close, assert_conv2d_matches_float64, conv_output_sizes,
                     depthwise_conv2d_float64, dtype_id, force_choice, poisoned, randn, reduce_depthwise_dw)

CL = torch.channels_last

# (B, C, H, W, KH, KW, stride, pad, dilation, bias)
CASES = [
    pytest.param((2, 24, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), True), id="3x3-pad1-bias"),
    pytest.param((2, 20, 9, 8, 5, 5, (2, 2), (2, 2), (1, 1), False), id="5x5-stride2"),
    pytest.param((2, 12, 10, 9, 3, 3, (2, 1), (2, 1), (2, 3), True), id="dilated-mixed-strides"),
    pytest.param((1, 40, 6, 11, 1, 7, (1, 1), (0, 3), (1, 1), False), id="1x7"),
    pytest.param((2, 13, 6, 7, 3, 3, (1, 1), (1, 1), (1, 1), True), id="odd-channels"),
]


def _stored(t):
    return t.permute(0, 2, 3, 1)


def _run_all(case, dtype, block_p=16, block_c=8, split=3):
    """(output, float64 reference, `assert_close` floor) of the forward, dx, dw and dbias of `case`, every
    kernel launched directly on channels-last tensors with tile BLOCK_P x BLOCK_C, dw in `split` slices and the
    channels' vector alignment as the plans set it (`channel_alignment`: 1 to 8)."""
    B, C, H, W, KH, KW, stride, pad, dil, has_bias = case
    OH, OW = conv_output_sizes((H, W), (KH, KW), stride, pad, dil)
    x = randn(B, C, H, W, dtype=dtype).contiguous(memory_format=CL)
    dy = randn(B, C, OH, OW, dtype=dtype).contiguous(memory_format=CL)
    w = randn(C, 1, KH, KW, dtype=dtype)
    bias = randn(C, dtype=dtype) if has_bias else None
    geometry, sizes = (KH, KW, *stride, *pad, *dil), (B, C, H, W, OH, OW)
    c_align = channel_alignment(C, x.element_size())
    y = poisoned(B, C, OH, OW, dtype=dtype).contiguous(memory_format=CL)
    Conv2dDepthwiseClForward(*geometry, has_bias, block_p, block_c, c_align, dtype=dtype).launch(
        _stored(x), w, bias if has_bias else _stored(y), _stored(y), *sizes)
    dx = poisoned(B, C, H, W, dtype=dtype).contiguous(memory_format=CL)
    Conv2dDepthwiseClDx(*geometry, block_p, block_c, c_align, dtype=dtype).launch(_stored(dy), w, _stored(dx),
                                                                                *sizes)
    partial = poisoned(split, dw_partial_size(C, 1, KH, KW, has_bias))
    Conv2dDepthwiseClDw(*geometry, has_bias, block_p, block_c, c_align, dtype=dtype).launch(
        _stored(dy), _stored(x), partial, *sizes, split)
    dw, dbias = reduce_depthwise_dw(partial, split, C, KH, KW, has_bias, dtype)
    y64, dx64, dw64, dbias64 = depthwise_conv2d_float64(x, w, bias, dy, stride, pad, dil)
    floor = dy.double().abs().sum((0, 2, 3)).norm().item()  # one channel's sums of many terms may cancel
    pairs = [(y, y64, 0.0), (dx, dx64, 0.0), (dw, dw64, floor)]
    return pairs + ([(dbias, dbias64, floor)] if has_bias else [])


@pytest.mark.parametrize("case", CASES)
def test_channels_last_depthwise_kernels_match_float64(case):
    for out, ref, floor in _run_all(case, torch.float32):
        assert_close(out, ref, torch.float32, floor=floor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_channels_last_depthwise_kernels_16bit(dtype):
    for out, ref, floor in _run_all(CASES[0].values[0], dtype, block_p=32, block_c=16, split=2):
        assert_close(out, ref, dtype, floor=floor)


def test_channel_alignment_is_the_largest_power_of_two_dividing_the_channels_up_to_16_bytes():
    """Where C is a multiple of 16, Triton's own specialisation says so: 1, and the kernels compile as without."""
    assert [channel_alignment(c, 2) for c in (72, 120, 40, 13, 20, 64, 96)] == [8, 8, 8, 1, 4, 1, 1]
    assert [channel_alignment(c, 4) for c in (72, 6, 13, 48)] == [4, 2, 1, 1]


@pytest.mark.parametrize("c_align", [3, 16])
def test_an_alignment_that_does_not_divide_the_channels_is_refused_with_nothing_written(c_align):
    x = randn(1, 24, 5, 5).contiguous(memory_format=CL)
    w = randn(24, 1, 3, 3)
    y = poisoned(1, 24, 5, 5).contiguous(memory_format=CL)
    kernel = Conv2dDepthwiseClForward(3, 3, 1, 1, 1, 1, 1, 1, False, 16, 8, c_align)
    with pytest.raises(ValueError, match=r"C_ALIGN: expected a power of two dividing C = 24, got " + str(c_align)):
        kernel.launch(_stored(x), w, _stored(y), _stored(y), 1, 24, 5, 5, 5, 5)
    assert y.isnan().all()


def test_every_result_is_the_same_bits_every_run():
    """dx gathers and dw's slices add in a fixed order: two runs on the same data agree bit for bit."""
    def run():
        torch.manual_seed(1)
        return [out for out, _, _ in _run_all(CASES[0].values[0], torch.float32)]

    assert all(torch.equal(one, two) for one, two in zip(run(), run()))


def _channels_last_first(listed):
    return next(choice for choice in listed if choice.algorithm.startswith("depthwise_cl_"))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES[:3])
def test_conv2d_reads_and_writes_channels_last_depthwise_in_place(case, dtype, monkeypatch):
    """The channels-last kernels chosen (on a GPU tuning may time the NCHW ones faster): no layout copy either
    way; y and dx channels-last as torch gives them; `kernels_for` names the launches."""
    force_choice(monkeypatch, _channels_last_first)
    monkeypatch.setattr(tuning, "peek", lambda kind, key, candidates, decode: _channels_last_first(candidates))
    B, C, H, W, KH, KW, stride, pad, dil, has_bias = case
    x = randn(B, C, H, W, dtype=dtype).contiguous(memory_format=CL).requires_grad_()
    w = randn(C, 1, KH, KW, dtype=dtype).requires_grad_()
    b = randn(C, dtype=dtype).requires_grad_() if has_bias else None
    options = (stride, pad, dil, C)
    y = conv2d(x, w, b, *options)
    dy = randn(*y.shape, dtype=dtype).contiguous(memory_format=CL)
    leaves = (x, w) + ((b,) if has_bias else ())
    grads = torch.autograd.grad(y, leaves, dy)
    launched = last_kernels("conv2d")
    ids = launched["forward"] + launched["backward"]
    assert [k.split("__")[0] for k in ids] == ["conv2d_depthwise_cl_forward", "conv2d_depthwise_cl_dx",
                                               "conv2d_depthwise_cl_dw", "conv2d_dw_reduce"]
    assert ids == kernels_for(x.shape, w.shape, stride, pad, dil, C, dtype=dtype, bias=has_bias, channels_last=True)
    assert y.is_contiguous(memory_format=CL) and not y.is_contiguous()
    assert grads[0].is_contiguous(memory_format=CL) and not grads[0].is_contiguous()
    assert_conv2d_matches_float64(y, grads, leaves, dy, options, dtype)


def test_tuning_times_the_channels_last_kernels_against_the_nchw_ones_through_copies(monkeypatch):
    """On a GPU both are offered; the NCHW choice, run on channels-last tensors, gives the same values."""
    from nnkernels import machine
    from nnkernels.functional.conv_algorithms import dw_pass, forward_pass
    from nnkernels.functional.conv_problem import Problem

    p = Problem((8, 32, 28, 28), (32, 1, 3, 3), (1, 1), (1, 1), (1, 1), 32, torch.bfloat16, True, GPU, nhwc=True)
    for pass_ in (forward_pass(p), dw_pass(p)):
        algorithms = [choice.algorithm for choice in pass_.candidates()]
        assert algorithms[0].startswith("depthwise_cl_") and any(a.startswith("depthwise_") and "_cl_" not in a
                                                                 for a in algorithms)
    offered = {}
    force_choice(monkeypatch, 1, offered)  # the second candidate: the NCHW kernels (interpreter: the only other)
    monkeypatch.setattr(machine, "machine_of", lambda device: GPU)
    x = randn(2, 16, 6, 5).contiguous(memory_format=CL).requires_grad_()
    w = randn(16, 1, 3, 3).requires_grad_()
    y = conv2d(x, w, None, 1, 1, 1, 16)
    dy = randn(*y.shape).contiguous(memory_format=CL)
    grads = torch.autograd.grad(y, (x, w), dy)
    assert "channels_last_copy" in " ".join(last_kernels("conv2d")["forward"])
    assert y.is_contiguous(memory_format=CL) and grads[0].is_contiguous(memory_format=CL)
    assert_conv2d_matches_float64(y, grads, (x, w), dy, ((1, 1), (1, 1), (1, 1), 16), torch.float32)


def test_on_a_gpu_quick_tuning_times_both_kinds_of_depthwise_kernel():
    """3x3 and 5x5 windows alike: the channels-last kernels first, the NCHW ones second, so the three candidates
    quick tuning times hold both (on an H100 the 5x5 channels-last forward won at stride 2, its dx and dw lost)."""
    from nnkernels import tuning
    from nnkernels.functional.conv_algorithms import dw_pass, dx_pass, forward_pass
    from nnkernels.functional.conv_problem import Problem

    for k in (3, 5):
        p = Problem((32, 72, 56, 56), (72, 1, k, k), (2, 2), (k // 2, k // 2), (1, 1), 72, torch.bfloat16, False,
                    GPU, nhwc=True)
        for pass_ in (forward_pass(p), dx_pass(p), dw_pass(p)):
            timed = [choice.algorithm for choice in pass_.candidates()[:tuning.QUICK_CANDIDATES]]
            assert "_cl_" in timed[0] and "_cl_" not in timed[1], (k, timed)
