"""conv_transpose2d and nnkernels.nn.ConvTranspose2d: y and the gradients of x, weight and bias against torch's
transposed convolution in float64 on the same data, for every dtype; the output layout torch gives; the layer's
`output_size`; second derivatives; the custom operators (opcheck, torch.compile); and bad input, with torch's
errors naming the argument.

The op runs the plan of the convolution whose input gradient it is (`functional/conv_transpose.py`), so the
kernels are the convolution's own, tested in the conv2d suites.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from support import DEVICE, DTYPES, assert_close, dtype_id, randn

import nnkernels.nn as nnk
from nnkernels.functional import conv_transpose2d

pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/conftest.py: TF32 off on both sides

CL = torch.channels_last

# (B, C_IN, C_OUT, H, W, kernel, stride, padding, output_padding, groups, dilation, bias)
CASES = [
    pytest.param((2, 16, 8, 4, 5, 2, 2, 0, 0, 1, 1, True), id="2x2-s2-upsampling"),
    pytest.param((2, 8, 6, 5, 4, 3, 2, 1, 1, 1, 1, True), id="3x3-s2-output-padding"),
    pytest.param((2, 16, 32, 4, 4, 4, 2, 1, 0, 1, 1, False), id="4x4-s2-p1"),
    pytest.param((1, 8, 8, 3, 5, 3, 1, 1, 0, 2, 2, True), id="grouped-dilated"),
    pytest.param((2, 16, 16, 5, 5, 3, 1, 1, 0, 1, 1, False), id="3x3-s1"),
]


def _tensors(case, dtype, x_format=torch.contiguous_format, w_format=torch.contiguous_format):
    B, C_IN, C_OUT, H, W, k, stride, padding, output_padding, groups, dilation, has_bias = case
    x = randn(B, C_IN, H, W, dtype=dtype).contiguous(memory_format=x_format).requires_grad_()
    w = randn(C_IN, C_OUT // groups, k, k, dtype=dtype).contiguous(memory_format=w_format).requires_grad_()
    b = randn(C_OUT, dtype=dtype).requires_grad_() if has_bias else None
    return x, w, b, (stride, padding, output_padding, groups, dilation)


def _references(leaves, options, dy):
    """torch's y and gradients in float64 on the CPU."""
    ref = [t.detach().double().cpu().requires_grad_() for t in leaves]
    y = F.conv_transpose2d(ref[0], ref[1], ref[2] if len(ref) > 2 else None, *options)
    return y, torch.autograd.grad(y, ref, dy.double().cpu())


def _check(case, dtype, x_format=torch.contiguous_format, w_format=torch.contiguous_format):
    x, w, b, options = _tensors(case, dtype, x_format, w_format)
    leaves = (x, w) + ((b,) if b is not None else ())
    y = conv_transpose2d(x, w, b, *options)
    dy = randn(*y.shape, dtype=dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_y, ref_grads = _references(leaves, options, dy)
    assert_close(y, ref_y, dtype)
    for grad, ref in zip(grads, ref_grads):
        assert_close(grad, ref, dtype, floor=ref.abs().sum().item() / ref.numel() ** 0.5)
    return y, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_conv_transpose2d_matches_float64(case, dtype):
    _check(case, dtype)


@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_channels_last_gives_torchs_layout(case):
    """A channels-last input or weight gives a channels-last output and input gradient, as torch's does."""
    for x_format, w_format in ((CL, torch.contiguous_format), (torch.contiguous_format, CL), (CL, CL)):
        y, grads = _check(case, torch.float32, x_format, w_format)
        x, w, b, options = _tensors(case, torch.float32, x_format, w_format)
        torch_y = F.conv_transpose2d(x.detach().cpu(), w.detach().cpu(), None, *options)
        assert y.is_contiguous(memory_format=CL) == torch_y.is_contiguous(memory_format=CL), (x_format, w_format)
        assert y.is_contiguous() == torch_y.is_contiguous(), (x_format, w_format)


def test_unbatched_input_and_an_empty_batch():
    x, w, b = randn(8, 5, 4).requires_grad_(), randn(8, 6, 3, 3).requires_grad_(), randn(6).requires_grad_()
    y = conv_transpose2d(x, w, b, 2, 1, 1)
    dy = randn(*y.shape)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    ref_y, ref_grads = _references((x, w, b), (2, 1, 1), dy)
    assert y.shape == ref_y.shape == (6, 10, 8)
    assert_close(y, ref_y, torch.float32)
    for grad, ref in zip(grads, ref_grads):
        assert_close(grad, ref, torch.float32)
    empty = torch.empty(0, 8, 5, 4, device=DEVICE, requires_grad=True)
    y = conv_transpose2d(empty, w, b, 2, 1, 1)
    assert y.shape == (0, 6, 10, 8)
    dx, dw = torch.autograd.grad(y.sum(), (empty, w))
    assert dx.shape == empty.shape and not dw.any()


def test_the_layer_takes_output_size_and_converts():
    """nnkernels.nn.ConvTranspose2d is torch's layer (constructor, state_dict), its forward's `output_size`
    choosing the output padding; convert swaps torch's."""
    torch.manual_seed(0)
    reference = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1).to(DEVICE)
    ours = nnk.convert(copy.deepcopy(reference))
    assert type(ours) is nnk.ConvTranspose2d and ours.weight is not reference.weight
    assert ours.state_dict().keys() == reference.state_dict().keys()
    x = randn(2, 8, 5, 4)
    for output_size in (None, (9, 7), (10, 8), [2, 4, 10, 8]):
        y, ref = ours(x, output_size=output_size), reference.cpu().double()(x.cpu().double(), output_size=output_size)
        reference.to(DEVICE).float()
        assert y.shape == ref.shape
        assert_close(y, ref, torch.float32)
    assert "nnkernels.ConvTranspose2d(8, 4" in repr(ours)


def test_second_derivatives_train_a_gradient_penalty():
    """create_graph=True: the gradients are differentiable convolutions, so d/dw of ||dy/dx||^2 is torch's."""
    x, w, b = randn(2, 4, 3, 3).requires_grad_(), randn(4, 3, 3, 3).requires_grad_(), randn(3).requires_grad_()
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    penalties = []
    for fn, (xi, wi, bi) in ((conv_transpose2d, (x, w, b)), (F.conv_transpose2d, (x64, w64, b64))):
        y = fn(xi, wi, bi, 2, 1, 1)
        (dx,) = torch.autograd.grad(y.square().sum(), xi, create_graph=True)
        penalties.append(torch.autograd.grad(dx.square().sum(), (wi, bi)))
    for ours, ref in zip(*penalties):
        assert_close(ours, ref, torch.float32)


def test_opcheck_and_torch_compile():
    x, w, b = randn(2, 8, 4, 5).requires_grad_(), randn(8, 6, 3, 3).requires_grad_(), randn(6).requires_grad_()
    torch.library.opcheck(torch.ops.nnkernels.conv_transpose2d.default, (x, w, b, [2, 2], [1, 1], [1, 0], 1, [1, 1]))
    layer = nnk.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=(1, 0)).to(DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert_close(y, F.conv_transpose2d(x.double(), layer.weight.double(), layer.bias.double(), 2, 1, (1, 0)))
    y.sum().backward()
    ref_x = x.detach().double().requires_grad_()
    F.conv_transpose2d(ref_x, layer.weight.double(), layer.bias.double(), 2, 1, (1, 0)).sum().backward()
    assert_close(x.grad, ref_x.grad, torch.float32)


@pytest.mark.parametrize("make, exception, message", [
    (lambda: conv_transpose2d(randn(2, 6, 4, 4), randn(8, 4, 3, 3)), ValueError, "input: expected 8 channels"),
    (lambda: conv_transpose2d(randn(2, 8, 4, 4), randn(8, 4, 3, 3), randn(5)), ValueError,
     r"bias: expected shape \(4,\)"),
    (lambda: conv_transpose2d(randn(2, 8, 4, 4), randn(8, 4, 3, 3), None, 2, 1, 2), ValueError,
     "output_padding: expected values smaller than either stride or dilation"),
    (lambda: conv_transpose2d(randn(2, 8, 4, 4), randn(8, 4, 3, 3), None, 1, 1, 1, 1, 2), NotImplementedError,
     "output_padding: nnkernels needs values below the stride"),
    (lambda: conv_transpose2d(randn(2, 8, 4, 4), randn(8, 4, 3, 3), groups=3), ValueError,
     "groups: 3 does not divide the input's 8 channels"),
    (lambda: conv_transpose2d(randn(2, 8, 4, 4), randn(8, 4, 3, 3, dtype=torch.bfloat16)), ValueError,
     "weight: expected dtype torch.float32 like input"),
    (lambda: conv_transpose2d(randn(2, 8, 1, 1), randn(8, 4, 1, 1), None, 1, 1), ValueError,
     "input: output size .* is too small"),
    (lambda: nnk.ConvTranspose2d(8, 4, 3, stride=1, output_padding=1, dilation=2), NotImplementedError,
     r"output_padding=\(1, 1\) is not supported"),
])
def test_bad_input_is_a_clear_error(make, exception, message):
    with pytest.raises(exception, match=message):
        make()
