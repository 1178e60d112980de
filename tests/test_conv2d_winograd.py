"""Winograd F(2x2, 3x3) (`ops/conv2d/winograd_*`, `functional/winograd`): each pass against torch's convolution
in float64, outputs poisoned with NaN, planes of odd sizes (ragged last tiles) and channel and tile counts that
fill no block; then `conv2d` with Winograd's configs chosen, forward and backward through autograd.
"""
import logging

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, assert_close, gpu, poisoned, randn

from nnkernels import tuning
from nnkernels.functional import winograd
from nnkernels.functional.conv2d import conv2d, kernels_for
from nnkernels.functional.conv2d_plan import Problem
from nnkernels.ops.conv2d.winograd_transforms import Conv2dWinogradInput, Conv2dWinogradOutput, tiles_of
from nnkernels.ops.conv2d.winograd_products import Conv2dWinogradProducts, products_row_size

# Three products per term keep fp32's accuracy; the transforms add a few roundings per output.
TOLERANCE = 1e-5
# (B, C_IN, C_OUT, H, W): odd and even planes, one row of tiles, channels in no block's multiple
CASES = [pytest.param((2, 5, 7, 7, 5), id="odd-plane"), pytest.param((1, 17, 3, 6, 8), id="even-plane"),
         pytest.param((3, 4, 9, 1, 9), id="one-row")]
CONFIG = tuning.Config(16, 16, 16, 4, 1, split=3, winograd=True)


def _problem(case):
    batch, c_in, c_out, height, width = case
    return randn(batch, c_in, height, width), randn(c_out, c_in, 3, 3), randn(c_out), randn(batch, c_out, height, width)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64(case, with_bias):
    x, w, b, _ = _problem(case)
    y = poisoned(case[0], case[2], case[3], case[4])
    winograd.forward(x, w, b if with_bias else None, y, CONFIG)
    assert_close(y, F.conv2d(x.double(), w.double(), b.double() if with_bias else None, padding=1), tol=TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_transposed_forward_is_dx(case):
    """With `transposed`, the forward of dy with the flipped, transposed filters is dx."""
    x, w, _, dy = _problem(case)
    dx = poisoned(*x.shape)
    winograd.forward(dy, w, None, dx, CONFIG, transposed=True)
    assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), padding=1), tol=TOLERANCE)


@pytest.mark.parametrize("split", [1, 3, 7], ids=["one-slice", "three-slices", "slices-past-the-tiles"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", CASES)
def test_weight_gradient_matches_float64(case, with_bias, split):
    """Split over the tiles (7 slices of 6 tiles' steps leave some slices empty: they write zeros); the bias
    gradient comes from point 5 of the transformed dy."""
    x, w, _, dy = _problem(case)
    dw, dbias = poisoned(*w.shape), poisoned(case[2])
    winograd.weight_gradient(dy, x, dw, dbias if with_bias else None, tuning.Config(16, 16, 16, 4, 1, split))
    assert_close(dw, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), padding=1), tol=TOLERANCE)
    if with_bias:
        assert_close(dbias, dy.double().sum((0, 2, 3)), tol=TOLERANCE)
    else:
        assert dbias.isnan().all()


def test_weight_gradient_is_bitwise_reproducible():
    x, w, _, dy = _problem((2, 16, 16, 9, 9))
    grads = []
    for _ in range(2):
        dw, dbias = poisoned(*w.shape), poisoned(16)
        winograd.weight_gradient(dy, x, dw, dbias, CONFIG)
        grads.append((dw, dbias))
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


def _prefer_winograd(monkeypatch):
    """Tuning answers with the first Winograd config wherever one is offered."""
    def choose(kind, key, candidates, run):
        listed = candidates()
        return next((config for config in listed if config.winograd), listed[0])
    monkeypatch.setattr(tuning, "choose", choose)


def test_conv2d_runs_winograd_forward_and_backward(monkeypatch, exact_fp32, caplog):
    """Through `conv2d` and autograd, with tuning answering Winograd: y, dx, dw and dbias against float64, and
    only Winograd's kernels launched."""
    _prefer_winograd(monkeypatch)
    x, w, b = randn(2, 64, 5, 7), randn(64, 64, 3, 3) * 0.1, randn(64)
    assert Problem(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1, torch.float32, True).winograd
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with caplog.at_level(logging.DEBUG, logger="nnkernels"):
        y = conv2d(*leaves, padding=1)
        dy = randn(*y.shape)
        y.backward(dy)
    launched = [record.getMessage().split()[-1].split("__")[0] for record in caplog.records
                if "launches" in record.getMessage()]
    assert launched == ["conv2d_winograd_weight", "conv2d_winograd_input", "conv2d_winograd_products",
                        "conv2d_winograd_output"] * 2 + ["conv2d_winograd_input", "conv2d_winograd_dy",
                                                         "conv2d_winograd_products", "conv2d_winograd_dw_finish"]
    refs = [t.double().cpu().requires_grad_() for t in (x, w, b)]
    y64 = F.conv2d(*refs, padding=1)
    y64.backward(dy.double().cpu())
    assert_close(y, y64, tol=TOLERANCE)
    for leaf, ref in zip(leaves, refs):
        assert_close(leaf.grad, ref.grad, tol=TOLERANCE)


def test_kernels_for_names_the_winograd_passes(monkeypatch, exact_fp32):
    monkeypatch.setattr(tuning, "peek", lambda kind, key, candidates: next(c for c in candidates if c.winograd))
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
                       False)
    assert problem.winograd == (change == "none")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's Inf - Inf
def test_an_inf_input_leaves_the_same_elements_non_finite():
    """Transforms add and subtract, so some of the outputs PyTorch gives as +-Inf come out NaN; the set of
    non-finite elements is PyTorch's, and every other element within tolerance."""
    x, w, _, _ = _problem((1, 8, 8, 6, 7))
    x[0, 2, 3, 3] = float("inf")
    y = poisoned(1, 8, 6, 7)
    winograd.forward(x, w, None, y, CONFIG)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    finite = ref.isfinite()
    assert torch.equal(y.isfinite(), finite)
    assert_close(y[finite], ref[finite], tol=TOLERANCE)


def test_the_switch_keeps_the_direct_kernels(monkeypatch, exact_fp32):
    shapes = ((2, 64, 14, 14), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, False)
    monkeypatch.setenv("NNKERNELS_WINOGRAD", "off")
    assert not Problem(*shapes).winograd
    monkeypatch.setenv("NNKERNELS_WINOGRAD", "sometimes")
    with pytest.raises(ValueError, match="^NNKERNELS_WINOGRAD: expected on or off"):
        Problem(*shapes)


@gpu
@pytest.mark.parametrize("size", [28, 13])
def test_resnet_layer_on_the_gpu(size):
    """A ResNet-50 3x3 layer's passes at tuning's first Winograd configs, against float64."""
    x, w, b, dy = _problem((4, 128, 128, size, size))
    y, dx, dw, dbias = poisoned(4, 128, size, size), poisoned(*x.shape), poisoned(*w.shape), poisoned(128)
    winograd.forward(x, w, b, y, tuning.winograd_candidates(128, 128)[0])
    winograd.forward(dy, w, None, dx, tuning.winograd_candidates(128, 128)[0], transposed=True)
    winograd.weight_gradient(dy, x, dw, dbias, tuning.winograd_dw_candidates(128, 128, tiles_of(4, size, size))[0])
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    assert_close(y, F.conv2d(x64, w64, b.double(), padding=1), tol=TOLERANCE)
    assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w64, dy64, padding=1), tol=TOLERANCE)
    assert_close(dw, torch.nn.grad.conv2d_weight(x64, w.shape, dy64, padding=1), tol=TOLERANCE)
    assert_close(dbias, dy64.sum((0, 2, 3)), tol=TOLERANCE)
