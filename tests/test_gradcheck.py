"""torch.autograd.gradcheck on every functional op, and what the ops do where gradcheck cannot go.

Found, not assumed: the functional ops refuse float64 with a TypeError naming the argument
(the kernels run fp32, fp16 and bf16 only), so float64 gradcheck is impossible. The best
available is gradcheck in float32 with a finite-difference step of 1e-3 and tolerances of
1e-2: float32 central differences carry ~1e-4 relative round-off, far below 1e-2, while a
wrong formula (a missing term, a transposed index) is off by O(1). On the CPU gradcheck runs in
fast mode (one random projection of the Jacobian: the interpreter pays ~0.1 s per launch and a
full Jacobian takes hundreds); on the GPU it checks the full Jacobian. On the GPU, TF32 is turned
off for these checks, since its 1e-3 rounding would swamp the finite differences.

Double backward is not implemented (the backward custom ops register no autograd formula):
gradgradcheck raises a RuntimeError naming the op, which is tested below, so second derivatives
are refused loudly rather than returned wrong.
"""
import warnings

import contextlib
import unittest.mock

import pytest
import torch
from support import DEVICE, INTERPRETED, randn

from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d

EPS, ATOL, RTOL = 1e-3, 1e-2, 1e-2
FAST = INTERPRETED


@pytest.fixture(autouse=True)
def float32_derivatives(exact_fp32):
    """No TF32 while checking derivatives (conftest's exact_fp32; see the module docstring), and gradcheck's
    warning about float32 inputs silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*double precision floating point.*")
        yield


def leaf(*shape):
    return randn(*shape).requires_grad_()


def gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=FAST)


CONV_CASES = [
    # (x shape, weight shape, bias, stride, padding, dilation, groups)
    pytest.param((2, 3, 5, 4), (4, 3, 3, 3), True, 1, 1, 1, 1, id="3x3-pad1-bias"),
    pytest.param((1, 4, 7, 6), (6, 2, 2, 3), False, (2, 1), (0, 1), (1, 2), 2, id="groups2-stride-dilation"),
    pytest.param((2, 3, 5, 5), (3, 1, 3, 3), True, 2, 1, 1, 3, id="depthwise-stride2-bias"),
    pytest.param((1, 2, 3, 3), (3, 2, 3, 3), True, 1, 0, 1, 1, id="kernel-equals-input"),
]


@pytest.mark.parametrize("x_shape, w_shape, has_bias, stride, padding, dilation, groups", CONV_CASES)
def test_conv2d_gradcheck(x_shape, w_shape, has_bias, stride, padding, dilation, groups):
    inputs = (leaf(*x_shape), leaf(*w_shape)) + ((leaf(w_shape[0]),) if has_bias else ())

    def fn(x, w, b=None):
        return conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)

    gradcheck(fn, inputs)


POOL_CASES = [
    # (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    pytest.param(2, None, 0, False, True, None, id="2x2"),
    pytest.param(3, 2, 1, True, False, None, id="3x3-pad-ceil-exclude-pad"),
    pytest.param((3, 2), (1, 2), (1, 0), False, True, 5, id="rect-divisor-override"),
]


@pytest.mark.parametrize("kernel_size, stride, padding, ceil_mode, count_include_pad, divisor", POOL_CASES)
def test_avg_pool2d_gradcheck(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor):
    def fn(x):
        return avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor)

    gradcheck(fn, (leaf(2, 3, 5, 6),))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_batch_norm_gradcheck(training, affine):
    C = 3
    running_mean = randn(C) * 0.1
    running_var = randn(C).abs() + 0.5
    params = (leaf(C), leaf(C)) if affine else ()

    def fn(x, weight=None, bias=None):
        # Statistics are read, never updated, here: gradcheck calls fn many times.
        stats = (None, None) if training else (running_mean, running_var)
        return batch_norm(x, *stats, weight, bias, training=training, eps=1e-5)

    gradcheck(fn, (leaf(2, C, 3, 4),) + params)


def test_batch_norm_gradcheck_2d_input():
    gradcheck(lambda x: batch_norm(x, None, None, training=True), (leaf(5, 3),))


FLOAT64_CALLS = [
    pytest.param(lambda x: conv2d(x, torch.ones(2, 3, 1, 1, dtype=torch.float64, device=DEVICE)), "input", id="conv2d"),
    pytest.param(lambda x: avg_pool2d(x, 2), "x", id="avg_pool2d"),
    pytest.param(lambda x: batch_norm(x, None, None, training=True), "x", id="batch_norm"),
]


@pytest.mark.parametrize("call, argument", FLOAT64_CALLS)
def test_float64_is_refused_naming_the_argument(call, argument):
    x = randn(2, 3, 4, 4).double()
    with pytest.raises(TypeError, match=rf"^{argument}: expected float32, float16 or bfloat16, got torch.float64"):
        call(x)


DOUBLE_BACKWARD = [
    pytest.param(lambda x: conv2d(x, torch.ones(2, 3, 3, 3, device=DEVICE), padding=1), "conv2d_backward",
                 id="conv2d"),
    pytest.param(lambda x: avg_pool2d(x, 2), "avg_pool2d_backward", id="avg_pool2d"),
    pytest.param(lambda x: batch_norm(x, None, None, training=True), "batch_norm_train_backward",
                 id="batch_norm-train"),
    pytest.param(lambda x: batch_norm(x, torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)),
                 "batch_norm_eval_backward", id="batch_norm-eval"),
]


@contextlib.contextmanager
def compiled_ops():
    """The functional ops as torch.compile runs them: through their custom operators."""
    with unittest.mock.patch("torch.compiler.is_compiling", lambda: True):
        yield


@pytest.mark.parametrize("fn, backward_op", DOUBLE_BACKWARD)
def test_double_backward_through_the_compiled_operators_is_refused_loudly(fn, backward_op):
    """Second derivatives through the custom operators torch.compile sees have no autograd formula: gradgradcheck
    must fail with torch's error, never run on and compare (or return) wrong second derivatives. (Eagerly they
    work: tests/test_double_backward.py.)"""
    x = leaf(2, 3, 4, 4)
    op = getattr(torch.ops.nnkernels, backward_op)
    assert op is not None
    with pytest.raises(RuntimeError, match=rf"nnkernels\.{backward_op}.*no autograd formula"), compiled_ops():
        torch.autograd.gradgradcheck(fn, (x,), eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=True)


@pytest.mark.parametrize("fn, backward_op", DOUBLE_BACKWARD)
def test_gradgradcheck_passes_eagerly_in_float32(fn, backward_op):
    """Second derivatives, eagerly: torch's finite-difference check of the backward, at fp32 tolerances."""
    x = leaf(2, 3, 4, 4)
    assert torch.autograd.gradgradcheck(fn, (x,), eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=True)
