"""The six seed kernels against PyTorch in float64, over shapes that are not multiples of the block."""
import pytest
import torch
import torch.nn.functional as F
from support import DTYPES, assert_close, dtype_id, poisoned, randn

import nnkernels as nk

# (B, C_IN, C_OUT, H, W, kh, kw, stride_h, stride_w, pad_h, pad_w, g, block_ow)
CONV_CASES = [
    pytest.param((2, 2, 4, 5, 7, 3, 3, 1, 1, 1, 1, 1, 4), id="OW>block,odd-HW"),
    pytest.param((1, 4, 4, 6, 5, 3, 2, 2, 1, 0, 1, 2, 8), id="groups2,rect-kernel,OW<block"),
    pytest.param((2, 3, 3, 5, 5, 3, 3, 1, 1, 1, 1, 3, 8), id="depthwise"),
    pytest.param((1, 2, 2, 7, 7, 1, 1, 3, 3, 0, 0, 1, 2), id="stride>kernel"),
]


def conv_sizes(case):
    B, C_IN, C_OUT, H, W, kh, kw, sh, sw, ph, pw, g, block_ow = case
    OH = (H + 2 * ph - kh) // sh + 1
    OW = (W + 2 * pw - kw) // sw + 1
    return B, C_IN, C_OUT, H, W, OH, OW


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_forward(case, dtype):
    B, C_IN, C_OUT, H, W, OH, OW = conv_sizes(case)
    kh, kw, sh, sw, ph, pw, g, block_ow = case[5:]
    x = randn(B, C_IN, H, W, dtype=dtype)
    w = randn(C_OUT, C_IN // g, kh, kw, dtype=dtype)
    y = poisoned(B, C_OUT, OH, OW, dtype=dtype)
    nk.Conv2dForward(kh, kw, sh, sw, ph, pw, g, block_ow, dtype=dtype).launch(x, w, y, B, C_IN, C_OUT, H, W, OH, OW)
    ref = F.conv2d(x.cpu().double(), w.cpu().double(), stride=(sh, sw), padding=(ph, pw), groups=g)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize(
    "case,dtype",
    [pytest.param(c.values[0], torch.float32, id=f"{c.id}-fp32") for c in CONV_CASES]
    + [
        pytest.param(CONV_CASES[0].values[0], torch.float16, id=f"{CONV_CASES[0].id}-fp16"),
        pytest.param(CONV_CASES[1].values[0], torch.bfloat16, id=f"{CONV_CASES[1].id}-bf16"),
    ],
)
def test_conv2d_backward(case, dtype):
    B, C_IN, C_OUT, H, W, OH, OW = conv_sizes(case)
    kh, kw, sh, sw, ph, pw, g, block_ow = case[5:]
    x = randn(B, C_IN, H, W, dtype=dtype)
    w = randn(C_OUT, C_IN // g, kh, kw, dtype=dtype)
    dy = randn(B, C_OUT, OH, OW, dtype=dtype)
    dx = torch.zeros_like(x)  # the contract: dx and dw zero-initialised, since the kernel accumulates
    dw = torch.zeros_like(w)
    kernel = nk.Conv2dBackward(kh, kw, sh, sw, ph, pw, g, block_ow, dtype=dtype)
    kernel.launch(dy, x, w, dx, dw, B, C_IN, C_OUT, H, W, OH, OW)
    x64 = x.cpu().double().requires_grad_()
    w64 = w.cpu().double().requires_grad_()
    F.conv2d(x64, w64, stride=(sh, sw), padding=(ph, pw), groups=g).backward(dy.cpu().double())
    assert_close(dx, x64.grad, dtype)
    assert_close(dw, w64.grad, dtype)


# (B, C, H, W, kh, kw, stride_h, stride_w, block_ow)
POOL_CASES = [
    pytest.param((2, 3, 7, 9, 2, 2, 2, 2, 4), id="k2s2,odd-HW,OW=block"),
    pytest.param((1, 2, 6, 5, 3, 2, 1, 2, 8), id="overlapping,rect"),
    pytest.param((2, 2, 7, 7, 2, 2, 3, 3, 2), id="stride>kernel"),
]


def pool_sizes(case):
    B, C, H, W, kh, kw, sh, sw, block_ow = case
    return B, C, H, W, (H - kh) // sh + 1, (W - kw) // sw + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", POOL_CASES)
def test_avgpool2d_forward_and_backward(case, dtype):
    B, C, H, W, OH, OW = pool_sizes(case)
    kh, kw, sh, sw, block_ow = case[4:]
    x = randn(B, C, H, W, dtype=dtype)
    y = poisoned(B, C, OH, OW, dtype=dtype)
    nk.Avgpool2dForward(kh, kw, sh, sw, block_ow, dtype=dtype).launch(x, y, B, C, H, W, OH, OW)
    x64 = x.cpu().double().requires_grad_()
    ref = F.avg_pool2d(x64, (kh, kw), (sh, sw))
    assert_close(y, ref, dtype)

    dy = randn(B, C, OH, OW, dtype=dtype)
    dx = torch.zeros_like(x)  # the contract: dx zero-initialised
    nk.Avgpool2dBackward(kh, kw, sh, sw, block_ow, dtype=dtype).launch(dy, dx, B, C, H, W, OH, OW)
    ref.backward(dy.cpu().double())
    assert_close(dx, x64.grad, dtype)


# (B, C, H, W, block_hw)
BN_CASES = [pytest.param((3, 4, 5, 7, 16), id="HW=35,3-blocks"), pytest.param((1, 2, 3, 3, 64), id="B1,HW<block")]


def bn_inputs(B, C, H, W, dtype):
    x = randn(B, C, H, W, dtype=dtype)
    weight = randn(C, dtype=dtype)
    bias = randn(C, dtype=dtype)
    mean = randn(C, dtype=dtype)
    var = (randn(C, dtype=torch.float32).abs() + 0.5).to(dtype)
    return x, weight, bias, mean, var


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_inference_forward(case, dtype):
    B, C, H, W, block_hw = case
    x, weight, bias, mean, var = bn_inputs(B, C, H, W, dtype)
    y = poisoned(B, C, H, W, dtype=dtype)
    eps = 1e-3
    nk.BatchNorm2dNchwForwardInference(block_hw, dtype=dtype).launch(x, y, weight, bias, mean, var, C, H * W, eps)
    d = [t.cpu().double() for t in (x, mean, var, weight, bias)]
    ref = F.batch_norm(d[0], d[1], d[2], d[3], d[4], training=False, eps=eps)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_backward_frozen_statistics(case, dtype):
    B, C, H, W, block_hw = case
    x, weight, bias, mean, var = bn_inputs(B, C, H, W, dtype)
    dy = randn(B, C, H, W, dtype=dtype)
    dx = poisoned(B, C, H, W, dtype=dtype)
    dweight = poisoned(C, dtype=dtype)
    dbias = poisoned(C, dtype=dtype)
    eps = 1e-3
    kernel = nk.BatchNorm2dNchwBackward(block_hw, dtype=dtype)
    kernel.launch(dy, x, dx, weight, mean, var, dweight, dbias, B, C, H * W, eps)
    d = [t.cpu().double().requires_grad_() for t in (x, weight, bias)]
    ref = F.batch_norm(d[0], mean.cpu().double(), var.cpu().double(), d[1], d[2], training=False, eps=eps)
    ref.backward(dy.cpu().double())
    assert_close(dx, d[0].grad, dtype)
    assert_close(dweight, d[1].grad, dtype)
    assert_close(dbias, d[2].grad, dtype)
