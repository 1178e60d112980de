"""The unfolded convolution backward (at most 4 input channels, large planes: the RGB stem) and the fp32 weight
gradient of small planes from columns laid out rows-outer: `Unfold2d` (both layouts) bit-exact against torch's
`F.unfold`, `Fold2d` against `F.fold` in float64, the fp32 columns of `Conv2dPointwiseFp32Out`, and
nnkernels.conv2d on both paths against torch in float64, with TF32 on and off; outputs poisoned, ragged tiles,
bad launches write nothing."""

import pytest
import torch
import torch.nn.functional as F
from support import (CONV_TF32_TOLERANCE, DEVICE, DTYPES, TOLERANCE, assert_close, dtype_id, gpu, poisoned,
                     randn)

from nnkernels.functional.unfold import fold_into, unfold
from nnkernels.ops.conv2d.pointwise import Conv2dPointwiseFp32Out
from nnkernels.ops.conv2d.unfold import Fold2d, Unfold2d
from nnkernels.functional import conv as conv_module
from nnkernels.functional import conv_problem as plan_module
from nnkernels.functional.conv_algorithms import unfolded

# (B, C, H, W), (KH, KW), stride, padding, dilation
GEOMETRIES = [
    ((2, 3, 11, 10), (7, 7), (2, 2), (3, 3), (1, 1)),  # the stem's, on a small plane
    ((1, 2, 9, 8), (3, 2), (2, 3), (0, 1), (2, 1)),  # uneven everything
    ((2, 1, 6, 7), (3, 3), (1, 1), (1, 1), (1, 1)),
    ((1, 4, 5, 5), (5, 5), (3, 3), (2, 2), (1, 1)),  # taps that no output pixel of a phase reads
]


def _geometry(kernel, stride, padding, dilation):
    return (*kernel, *stride, *padding, *dilation)


def _out_size(shape, kernel, stride, padding, dilation):
    return tuple((shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
                 for i in range(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", GEOMETRIES, ids=lambda v: "x".join(map(str, v)))
def test_unfold_equals_torch_and_fold_is_its_adjoint(shape, kernel, stride, padding, dilation, dtype):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[:4] = torch.tensor([-0.0, float("inf"), float("nan"), -float("inf")])  # copied bit for bit
    out = _out_size(shape, kernel, stride, padding, dilation)
    columns = unfold(x, _geometry(kernel, stride, padding, dilation), out)
    reference = F.unfold(x.cpu(), kernel, dilation, padding, stride).reshape(columns.shape)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert columns.dtype == dtype and torch.equal(columns.cpu().view(bits), reference.view(bits))
    rows_outer = unfold(x, _geometry(kernel, stride, padding, dilation), out, rows_outer=True)
    assert torch.equal(rows_outer.cpu().view(bits), reference.transpose(0, 1).contiguous().view(bits))
    x = x.nan_to_num(posinf=1.0, neginf=-1.0)
    grad = randn(*columns.shape)  # fp32 columns, as dx's
    dx = poisoned(*shape, dtype=dtype)
    fold_into(grad, dx, _geometry(kernel, stride, padding, dilation))
    expected = F.fold(grad.double().cpu().reshape(shape[0], columns.shape[1], -1), shape[2:], kernel, dilation,
                      padding, stride)
    assert_close(dx, expected, tol=TOLERANCE[dtype] if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_kernels_on_ragged_tiles_write_every_element(dtype):
    """5x5 output planes and 5x5 phase planes in ragged 2 x 4 tiles (the unfold's of 4 images, of which 2 exist),
    every output poisoned first."""
    shape, geometry, out = (2, 3, 9, 10), (3, 3, 2, 2, 1, 1, 1, 1), (5, 5)
    x = randn(*shape, dtype=dtype)
    reference = F.unfold(x.double().cpu(), 3, 1, 1, 2).to(dtype).reshape(2, 27, *out)
    for rows_outer, expected in ((False, reference), (True, reference.transpose(0, 1))):
        columns = poisoned(*expected.shape, dtype=dtype)
        Unfold2d(*geometry, rows_outer, 4, 2, 4, dtype=dtype).launch(x, columns, 6, 3, 9, 10, *out)
        assert torch.equal(columns.cpu(), expected)
    grad = randn(2, 27, *out)
    dx = poisoned(*shape, dtype=dtype)
    Fold2d(*geometry, 2, 4, dtype=dtype).launch(grad, dx, 6, 9, 10, *out)
    expected = F.fold(grad.double().cpu().reshape(2, 27, -1), (9, 10), 3, 1, 1, 2)
    assert_close(dx, expected, tol=TOLERANCE[dtype] if dtype != torch.float32 else 1e-6)


def test_launches_refuse_wrong_sizes_and_write_nothing():
    x, columns = randn(2, 3, 9, 10), poisoned(2, 27, 5, 5)
    kernel = Unfold2d(3, 3, 2, 2, 1, 1, 1, 1, False, 1, 2, 4)
    for args, message in [
        ((x, columns, 6, 3, 9, 10, 4, 5), r"^OH: expected \(H \+ 2\*PAD_H - DIL_H\*\(KH-1\)\+1\) // STRIDE_H \+ 1 = 5"),
        ((x, poisoned(2, 27, 5, 4), 6, 3, 9, 10, 5, 4), r"^OW: expected .* = 5, got 4"),
        ((x, columns, 5, 1, 9, 10, 5, 5), r"^x: expected PLANES\*H\*W = 450 elements, got 540"),
        ((x, columns, 6, 4, 9, 10, 5, 5), r"^CHANNELS: expected a positive divisor of PLANES \(6\), got 4"),
    ]:
        with pytest.raises(ValueError, match=message):
            kernel.launch(*args)
        assert torch.isnan(columns).all()
    dx = poisoned(2, 3, 9, 10, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^columns: expected dtype torch.float32"):  # fp32 sums, not bf16
        Fold2d(3, 3, 2, 2, 1, 1, 1, 1, 2, 4, dtype=torch.bfloat16).launch(columns.bfloat16(), dx, 6, 9, 10, 5, 5)
    assert torch.isnan(dx).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_dx_columns_stay_in_fp32(dtype):
    """`Conv2dPointwiseFp32Out` keeps w @ x[b] in fp32 for 16-bit inputs: within fp32 sums' error of
    the exact product, far below a 16-bit rounding."""
    x, w = randn(2, 20, 37, dtype=dtype), randn(30, 20, dtype=dtype)
    for w_transposed, weight in ((False, w), (True, w.t().contiguous())):  # dx reads the forward's w^T
        y = poisoned(2, 30, 37)
        Conv2dPointwiseFp32Out(True, w_transposed, 16, 16, 16, 0, dtype=dtype).launch(x, weight, y, 2, 20, 30, 37)
        assert_close(y, w.double().cpu() @ x.double().cpu(), tol=1e-6)


# (B, C_IN, C_OUT, H, W, (KH, KW), stride, padding, dilation, bias)
CONVOLUTIONS = [
    pytest.param((2, 3, 16, 13, 12, (7, 7), 2, 3, 1, True), id="stem-like"),
    pytest.param((1, 4, 6, 9, 10, (3, 3), (2, 1), (0, 2), 2, True), id="strided-dilated-uneven-padding"),
    pytest.param((2, 1, 4, 6, 5, (3, 2), 1, 1, 1, False), id="one-channel"),
]


@pytest.mark.parametrize("dtype, tf32", [(torch.float32, False), (torch.float32, True), (torch.float16, False),
                                         (torch.bfloat16, False)], ids=["fp32", "fp32-tf32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CONVOLUTIONS)
def test_conv2d_on_the_unfolded_path_matches_torch(case, dtype, tf32, monkeypatch):
    monkeypatch.setattr(plan_module, "UNFOLD_MIN_PIXELS", 1)  # small planes, the path of large ones
    B, C_IN, C_OUT, H, W, kernel, stride, padding, dilation, has_bias = case
    assert conv_module.kernels_for((B, C_IN, H, W), (C_OUT, C_IN, *kernel), stride, padding, dilation,
                                   dtype=dtype)[1].startswith("conv2d_pointwise_fp32_out")
    x = randn(B, C_IN, H, W, dtype=dtype).requires_grad_()
    w = randn(C_OUT, C_IN, *kernel, dtype=dtype).requires_grad_()
    b = randn(C_OUT, dtype=dtype).requires_grad_() if has_bias else None
    with torch.backends.cudnn.flags(allow_tf32=tf32):
        y = conv_module.conv2d(x, w, b, stride, padding, dilation)
        dy = torch.randn_like(y)
        y.backward(dy)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    b64 = b.detach().double().cpu().requires_grad_() if has_bias else None
    y64 = F.conv2d(x64, w64, b64, stride, padding, dilation)
    y64.backward(dy.double().cpu())
    # fp32 with TF32 allowed: bf16x3 products for y and dx, TF32 ones for dw on the GPU; without, fp32 FMA.
    tol = CONV_TF32_TOLERANCE if tf32 else TOLERANCE[dtype]
    for out, ref in [(y, y64), (x.grad, x64.grad), (w.grad, w64.grad)] + ([(b.grad, b64.grad)] if has_bias else []):
        assert out.dtype == dtype
        assert_close(out, ref, tol=tol)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_the_stem_takes_the_unfolded_path_on_the_gpu(dtype):
    """ResNet's stem, 3->64 7x7 stride 2 at 224x224, batch 2, TF32 off: every output against float64."""
    assert conv_module.kernels_for((2, 3, 224, 224), (64, 3, 7, 7), 2, 3, dtype=dtype)[1].startswith(
        "conv2d_pointwise_fp32_out")
    x = randn(2, 3, 224, 224, dtype=dtype).requires_grad_()
    w = randn(64, 3, 7, 7, dtype=dtype).requires_grad_()
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = conv_module.conv2d(x, w, None, 2, 3)
        dy = torch.randn_like(y)
        y.backward(dy)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    y64 = F.conv2d(x64, w64, None, 2, 3)
    y64.backward(dy.double().cpu())
    for out, ref in [(y, y64), (x.grad, x64.grad), (w.grad, w64.grad)]:
        assert out.device.type == DEVICE
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "fp32-tf32"])
@pytest.mark.parametrize("slice_bytes", [2**30, 1], ids=["one-slice", "a-slice-per-image"])
def test_conv2d_rows_outer_dw_matches_torch(slice_bytes, tf32, monkeypatch):
    """fp32 at stride 1 on a small plane: dw (and dbias) as one 1x1 product of the input and dy unfolded
    rows-outer, in one slice of the batch or one per image, against float64."""
    monkeypatch.setattr(unfolded, "UNFOLD_SLICE_BYTES", slice_bytes)
    x = randn(3, 16, 5, 6).requires_grad_()
    w = randn(32, 16, 3, 3).requires_grad_()
    b = randn(32).requires_grad_()
    names = [k.split("__")[0] for k in conv_module.kernels_for(x.shape, w.shape, 1, (1, 2), bias=True)]
    assert names[-4:] == ["unfold2d", "unfold2d", "conv2d_pointwise_dw", "conv2d_dw_reduce"]
    with torch.backends.cudnn.flags(allow_tf32=tf32):
        y = conv_module.conv2d(x, w, b, 1, (1, 2))
        dy = torch.randn_like(y)
        y.backward(dy)
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    F.conv2d(x64, w64, b64, 1, (1, 2)).backward(dy.double().cpu())
    tol = CONV_TF32_TOLERANCE if tf32 else TOLERANCE[torch.float32]
    for out, ref in [(x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)]:
        assert_close(out, ref, tol=tol)


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "fp32-tf32"])
def test_resnet_7x7_layer_takes_the_rows_outer_dw_on_the_gpu(tf32):
    """ResNet-50's last 3x3 layer (512 channels on 7x7 planes), batch 4: dw against float64."""
    names = [k.split("__")[0] for k in conv_module.kernels_for((4, 512, 7, 7), (512, 512, 3, 3), 1, 1)]
    assert names[-4:] == ["unfold2d", "unfold2d", "conv2d_pointwise_dw", "conv2d_dw_reduce"]
    x, w = randn(4, 512, 7, 7).requires_grad_(), randn(512, 512, 3, 3).requires_grad_()
    with torch.backends.cudnn.flags(allow_tf32=tf32):
        y = conv_module.conv2d(x, w, None, 1, 1)
        dy = torch.randn_like(y)
        y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.conv2d(x64, w64, None, 1, 1).backward(dy.double())
    assert_close(w.grad, w64.grad, tol=CONV_TF32_TOLERANCE if tf32 else TOLERANCE[torch.float32])
