"""Winograd F(2x2, 3x3) (`ops/conv2d/winograd_*`, `functional/conv_algorithms/winograd.py`): each pass against
torch's convolution in float64, outputs poisoned with NaN, planes of odd sizes (ragged last tiles) and channel
and tile counts that fill no block; then `conv2d` with Winograd's configs chosen, forward and backward through
autograd.
"""
import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, GPU, assert_close, gpu, poisoned, randn

from nnkernels import machine, tuning
from nnkernels.functional import last_kernels
from nnkernels.functional.conv import conv2d, kernels_for
from nnkernels.functional.conv_algorithms.base import GemmConfig
from nnkernels.functional.conv_algorithms.winograd import (WinogradDw, WinogradForward, winograd_candidates,
                                                           winograd_dw_candidates)
from nnkernels.functional.conv_problem import Problem
from nnkernels.ops.conv2d.winograd_transforms import Conv2dWinogradInput, Conv2dWinogradOutput, tiles_of
from nnkernels.ops.conv2d.winograd_products import Conv2dWinogradProducts, products_row_size

# Three products per term keep fp32's accuracy; the transforms add a few roundings per output.
TOLERANCE = 1e-5
# (B, C_IN, C_OUT, H, W): odd and even planes, one row of tiles, channels in no block's multiple
CASES = [pytest.param((2, 5, 7, 7, 5), id="odd-plane"), pytest.param((1, 17, 3, 6, 8), id="even-plane"),
         pytest.param((3, 4, 9, 1, 9), id="one-row")]
CONFIG = GemmConfig(16, 16, 16, 4, 1, split=3)


def _problem(case):
    batch, c_in, c_out, height, width = case
    return randn(batch, c_in, height, width), randn(c_out, c_in, 3, 3), randn(c_out), randn(batch, c_out, height, width)


def _on(x_shape, w_shape, has_bias, flip_taps=False):
    """The 3x3 stride-1 pad-1 fp32 problem of these shapes on the suite's device."""
    device = torch.device(DEVICE)
    return Problem(x_shape, w_shape, (1, 1), (1, 1), (1, 1), 1, torch.float32, has_bias, machine.machine_of(device),
                   tf32=False, flip_taps=flip_taps, device=device)


def forward(x, w, b, config):
    return WinogradForward().runner(_on(x.shape, w.shape, b is not None), config)(x, w, b)


def transposed_forward(dy, w, config):
    """dx of the convolution with weight w, as the forward of dy with the flipped, transposed filters."""
    return WinogradForward().runner(_on(dy.shape, (w.shape[1], w.shape[0], 3, 3), False, flip_taps=True),
                                    config)(dy, w, None)


def weight_gradient(dy, x, w_shape, with_bias, config):
    return WinogradDw().runner(_on(x.shape, w_shape, with_bias), config)(dy, x, None)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64(case, with_bias, poisoned_outputs):
    x, w, b, _ = _problem(case)
    y = forward(x, w, b if with_bias else None, CONFIG)
    assert_close(y, F.conv2d(x.double(), w.double(), b.double() if with_bias else None, padding=1), tol=TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_transposed_forward_is_dx(case, poisoned_outputs):
    """The forward of dy with the flipped, transposed filters is dx."""
    x, w, _, dy = _problem(case)
    dx = transposed_forward(dy, w, CONFIG)
    assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), padding=1), tol=TOLERANCE)


@pytest.mark.parametrize("split", [1, 3, 7], ids=["one-slice", "three-slices", "slices-past-the-tiles"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", CASES)
def test_weight_gradient_matches_float64(case, with_bias, split, poisoned_outputs):
    """Split over the tiles (7 slices of 6 tiles' steps leave some slices empty: they write zeros); the bias
    gradient comes from point 5 of the transformed dy."""
    x, w, _, dy = _problem(case)
    dw, dbias = weight_gradient(dy, x, w.shape, with_bias, GemmConfig(16, 16, 16, 4, 1, split))
    assert_close(dw, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), padding=1), tol=TOLERANCE)
    if with_bias:
        assert_close(dbias, dy.double().sum((0, 2, 3)), tol=TOLERANCE)
    else:
        assert dbias is None


def test_weight_gradient_is_bitwise_reproducible():
    x, w, _, dy = _problem((2, 16, 16, 9, 9))
    grads = [weight_gradient(dy, x, w.shape, True, CONFIG) for _ in range(2)]
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_products_match_matmul_per_point():
    """c[s, z] = a[z] @ b[z]^T over slice s of K, and the bias sums of a[5] after the 16 products."""
    m, n, k, split = 5, 19, 37, 2
    a, b = randn(16, m, k), randn(16, n, k)
    c = poisoned(split, products_row_size(m, n, True))
    Conv2dWinogradProducts(True, False, 16, 16, 16).launch(a, b, c, m, n, k, split)
    slice_len = 32  # cdiv(cdiv(37, 2), 16) * 16
    for s in range(split):
        ks = slice(s * slice_len, min(k, (s + 1) * slice_len))
        expected = torch.einsum("zmk,znk->zmn", a[:, :, ks].double(), b[:, :, ks].double())
        assert_close(c[s, :16 * m * n].reshape(16, m, n), expected, tol=TOLERANCE)
        assert_close(c[s, 16 * m * n:], a[5, :, ks].double().sum(1), tol=TOLERANCE)


def test_launch_checks_name_the_argument():
    x = randn(2, 3, 5, 5)
    with pytest.raises(ValueError, match="^u: expected 16\\*T\\*C"):
        Conv2dWinogradInput(True, 16, 16).launch(x, torch.empty(16 * 18 * 3 - 1, device=DEVICE), 2, 3, 5, 5)
    with pytest.raises(ValueError, match="^bias: expected C"):
        Conv2dWinogradOutput(True, 16, 16).launch(torch.empty(16 * 18 * 3, device=DEVICE), randn(2), x, 2, 3, 5, 5)
    with pytest.raises(ValueError, match="^SPLIT: expected at most K"):
        Conv2dWinogradProducts(False, False, 16, 16, 16).launch(randn(16, 2, 3), randn(16, 2, 3),
                                                                torch.empty(4 * 64, device=DEVICE), 2, 2, 3, 4)
    assert tiles_of(2, 5, 5) == 18


def _winograd_first(listed):
    return next((choice for choice in listed if choice.algorithm.startswith("winograd")), listed[0])


def _prefer_winograd(monkeypatch):
    """Tuning answers with the first Winograd config wherever one is offered."""
    monkeypatch.setattr(tuning, "choose", lambda kind, key, candidates, run, decode: _winograd_first(candidates()))


def test_conv2d_runs_winograd_forward_and_backward(monkeypatch, exact_fp32, gpu_lists):
    """Through `conv2d` and autograd, with tuning answering Winograd (from the GPU's lists, which offer it beside
    the direct kernels): y, dx, dw and dbias against float64, and only Winograd's kernels launched."""
    _prefer_winograd(monkeypatch)
    x, w, b = randn(2, 64, 5, 7), randn(64, 64, 3, 3) * 0.1, randn(64)
    assert _on(x.shape, w.shape, True).winograd
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = conv2d(*leaves, padding=1)
    dy = randn(*y.shape)
    y.backward(dy)
    launched = {step: [kernel_id.split("__")[0] for kernel_id in ids]
                for step, ids in last_kernels("conv2d").items()}
    forward_kernels = ["conv2d_winograd_weight", "conv2d_winograd_input", "conv2d_winograd_products",
                       "conv2d_winograd_output"]
    assert launched == {"forward": forward_kernels, "backward": forward_kernels + [
        "conv2d_winograd_input", "conv2d_winograd_dy", "conv2d_winograd_products", "conv2d_winograd_dw_finish"]}
    refs = [t.double().cpu().requires_grad_() for t in (x, w, b)]
    y64 = F.conv2d(*refs, padding=1)
    y64.backward(dy.double().cpu())
    assert_close(y, y64, tol=TOLERANCE)
    for leaf, ref in zip(leaves, refs):
        assert_close(leaf.grad, ref.grad, tol=TOLERANCE)


def test_kernels_for_names_the_winograd_passes(monkeypatch, exact_fp32, gpu_lists):
    monkeypatch.setattr(tuning, "peek", lambda kind, key, candidates, decode: _winograd_first(candidates))
    names = [kernel_id.split("__")[0] for kernel_id in kernels_for((2, 64, 9, 9), (64, 64, 3, 3), padding=1)]
    forward = ["conv2d_winograd_weight", "conv2d_winograd_input", "conv2d_winograd_products", "conv2d_winograd_output"]
    assert names == forward * 2 + ["conv2d_winograd_input", "conv2d_winograd_dy", "conv2d_winograd_products",
                                   "conv2d_winograd_dw_finish"]


@pytest.mark.parametrize("change", ["none", "tf32", "bf16", "stride-2", "32-channels", "5x5", "groups-2"])
def test_winograd_is_offered_only_to_full_fp32_3x3_stride_1(change, exact_fp32):
    torch.backends.cudnn.allow_tf32 = change == "tf32"  # exact_fp32 restores it
    c_in = 32 if change == "32-channels" else 64
    k = 5 if change == "5x5" else 3
    groups = 2 if change == "groups-2" else 1
    problem = Problem((2, c_in, 14, 14), (64, c_in // groups, k, k), (2, 2) if change == "stride-2" else (1, 1),
                      ((k - 1) // 2,) * 2, (1, 1), groups, torch.bfloat16 if change == "bf16" else torch.float32,
                      False, GPU)
    assert problem.winograd == (change == "none")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's Inf - Inf
def test_an_inf_input_leaves_the_same_elements_non_finite():
    """Transforms add and subtract, so some of the outputs PyTorch gives as +-Inf come out NaN; the set of
    non-finite elements is PyTorch's, and every other element within tolerance."""
    x, w, _, _ = _problem((1, 8, 8, 6, 7))
    x[0, 2, 3, 3] = float("inf")
    y = forward(x, w, None, CONFIG)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    finite = ref.isfinite()
    assert torch.equal(y.isfinite(), finite)
    assert_close(y[finite], ref[finite], tol=TOLERANCE)


def test_the_switch_keeps_the_direct_kernels(monkeypatch, exact_fp32):
    shapes = ((2, 64, 14, 14), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, False, GPU)
    monkeypatch.setenv("NNKERNELS_WINOGRAD", "off")
    assert not Problem(*shapes).winograd
    monkeypatch.setenv("NNKERNELS_WINOGRAD", "sometimes")
    with pytest.raises(ValueError, match="^NNKERNELS_WINOGRAD: expected on or off"):
        Problem(*shapes)


@gpu
@pytest.mark.parametrize("size", [28, 13])
def test_resnet_layer_on_the_gpu(size, poisoned_outputs):
    """A ResNet-50 3x3 layer's passes at tuning's first Winograd configs, against float64."""
    x, w, b, dy = _problem((4, 128, 128, size, size))
    y = forward(x, w, b, winograd_candidates(128, 128, GPU)[0])
    dx = transposed_forward(dy, w, winograd_candidates(128, 128, GPU)[0])
    dw, dbias = weight_gradient(dy, x, w.shape, True, winograd_dw_candidates(128, 128, tiles_of(4, size, size), GPU)[0])
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    assert_close(y, F.conv2d(x64, w64, b.double(), padding=1), tol=TOLERANCE)
    assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w64, dy64, padding=1), tol=TOLERANCE)
    assert_close(dw, torch.nn.grad.conv2d_weight(x64, w.shape, dy64, padding=1), tol=TOLERANCE)
    assert_close(dbias, dy64.sum((0, 2, 3)), tol=TOLERANCE)
