"""Tensors of more than 2**31 elements (bf16, to fit): conv2d, avg_pool2d and batch_norm, forward
and backward, on the GPU, so every offset past 2**31 must be computed in 64 bits.

Shapes: [B, C, 256, 256] with B one image more than 2**31 elements hold, so the last image starts
at or past element 2**31. Outputs are checked on sampled images against PyTorch in fp32 (TF32
off) on the same bf16 inputs: the first image, the last image wholly below 2**31, the first at or
above it, and the last; sums over the whole batch (dw, dbias, batch-norm statistics and parameter
gradients) are checked in full, their references accumulated chunk by chunk in float64 or fp32.
Each test keeps its peak GPU memory under 60 GB (asserted) and should take well under 20 s
on an H200. The convolution with more than 2**31 pixels runs in a child process, since a wrapped
index could fault and poison the CUDA context of every later test.

On the CPU the same checks run once on tiny shapes, as a dry run of this file's logic.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import DEVICE, INTERPRETED, TOLERANCE, assert_close, gpu

from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
TOL = TOLERANCE[BF16]
LIMIT = 2**31
PEAK_BYTES = 60 * 10**9
HW = 256


def batch_past_limit(channels, hw=HW):
    """The smallest batch of [channels, hw, hw] images holding more than 2**31 elements."""
    return LIMIT // (channels * hw * hw) + 1


def sample_images(batch, per_image):
    """First, last below 2**31, first at or past 2**31, last (those that exist)."""
    crossing = LIMIT // per_image
    return sorted({b for b in (0, crossing - 1, crossing, batch - 1) if 0 <= b < batch})


def chunks(batch, per_image, elements=2**27):
    """Batch slices of about `elements` elements each (so that their float64 copies stay small)."""
    size = max(1, elements // per_image)
    return [slice(start, min(start + size, batch)) for start in range(0, batch, size)]


def channel_sums(tensor_fn, batch, per_image):
    """sum over (b, h, w) of tensor_fn(batch slice) (float64), per channel, chunk by chunk."""
    return sum(tensor_fn(part).sum(dim=(0, 2, 3)) for part in chunks(batch, per_image))


@pytest.fixture
def memory_budget(monkeypatch, exact_fp32):
    """No TF32 in the references (conftest's exact_fp32); no block-size tuning (it would compile and time
    several configs of each kernel on these huge tensors; the offsets under test do not depend on the tile
    sizes); peak GPU memory of the test under 60 GB."""
    monkeypatch.setenv("NNKERNELS_TUNE", "off")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if DEVICE == "cuda":
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        assert peak < PEAK_BYTES, f"peak GPU memory {peak / 1e9:.1f} GB >= 60 GB"


def bf16_randn(*shape, seed):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(shape, device=DEVICE, dtype=BF16, generator=generator)


def leaf(tensor):
    return tensor.requires_grad_()


# ---------------------------------------------------------------- conv2d

CONV_CASES = {
    # name: (C_IN, C_OUT, kernel, stride, padding, groups); channels multiple of 16 take the channels-last path.
    "channels-last-3x3": (32, 32, 3, 1, 1, 1),
    "nchw-3x3-stride2": (24, 24, 3, 2, 1, 1),
    "depthwise-3x3": (32, 32, 3, 1, 1, 32),
    "pointwise-1x1": (32, 32, 1, 1, 0, 1),
}
# One input channel: more than 2**31 pixels (B*OH*OW), so the GEMM's pixel index itself passes 2**31.
ONE_CHANNEL_CONV = (1, 2, 3, 1, 1, 1)


def check_conv2d(batch, c_in, c_out, kernel, stride, padding, groups, hw):
    x = leaf(bf16_randn(batch, c_in, hw, hw, seed=0))
    w = leaf(bf16_randn(c_out, c_in // groups, kernel, kernel, seed=1) * 0.2)
    b = leaf(bf16_randn(c_out, seed=2))
    options = dict(stride=stride, padding=padding, groups=groups)
    y = conv2d(x, w, b, **options)
    dy = bf16_randn(*y.shape, seed=3)
    y.backward(dy)
    assert y.numel() > 0 and x.grad.shape == x.shape
    w32, b32 = w.detach().float(), b.detach().float()
    # The images around 2**31 of x (and dx) and of y (and dy), whose images may differ in size.
    images = sorted(set(sample_images(batch, c_in * hw * hw)) | set(sample_images(batch, y[0].numel())))
    for i in images:
        x32 = x.detach()[i:i + 1].float()
        assert_close(y[i:i + 1], F.conv2d(x32, w32, b32, **options), tol=TOL)
        dx_ref = torch.nn.grad.conv2d_input(x32.shape, w32, dy[i:i + 1].float(), **options)
        assert_close(x.grad[i:i + 1], dx_ref, tol=TOL)
    dw_ref = torch.zeros(w.shape, device=DEVICE, dtype=torch.float64)
    per_image = max(c_in, c_out) * hw * hw
    for part in chunks(batch, per_image):
        dw_ref += torch.nn.grad.conv2d_weight(x.detach()[part].float(), w.shape, dy[part].float(), **options).double()
    db_ref = channel_sums(lambda part: dy[part].double(), batch, per_image)
    assert_close(w.grad, dw_ref, tol=TOL)
    assert_close(b.grad, db_ref, tol=TOL)


@gpu
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d_past_2_31_elements(case, memory_budget):
    c_in, c_out, kernel, stride, padding, groups = CONV_CASES[case]
    batch = batch_past_limit(c_in)
    assert batch * c_in * HW * HW > LIMIT
    check_conv2d(batch, c_in, c_out, kernel, stride, padding, groups, HW)


CHILD = """
import sys, torch
sys.path.insert(0, "tests")
import test_large_tensors as t
torch.backends.cudnn.allow_tf32 = False
t.check_conv2d({call})
if torch.cuda.is_available():
    peak = torch.cuda.max_memory_allocated()
    assert peak < t.PEAK_BYTES, f"peak GPU memory {{peak / 1e9:.1f}} GB >= 60 GB"
"""


def check_conv2d_in_a_child(*args):
    """check_conv2d(*args) in a child process (see test_conv2d_pixel_index_past_2_31)."""
    env = dict(os.environ, NNKERNELS_TUNE="off", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = CHILD.format(call=", ".join(map(str, args)))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"child process failed:\n{done.stderr[-3000:]}"


@gpu
def test_conv2d_pixel_index_past_2_31():
    """More than 2**31 pixels. Run in a child process: an index that wraps can make the kernel access
    memory outside its tensors, and a CUDA fault would poison this process's context for every later test."""
    c_in, c_out, kernel, stride, padding, groups = ONE_CHANNEL_CONV
    assert batch_past_limit(c_in) * HW * HW > LIMIT
    check_conv2d_in_a_child(batch_past_limit(c_in), c_in, c_out, kernel, stride, padding, groups, HW)


# ---------------------------------------------------------------- avg_pool2d

def check_avg_pool2d(batch, channels, hw):
    """3x3 windows, stride 1, padding 1: the output is as large as the input, so it too passes 2**31."""
    x = leaf(bf16_randn(batch, channels, hw, hw, seed=0))
    y = avg_pool2d(x, 3, 1, 1)
    dy = bf16_randn(*y.shape, seed=3)
    y.backward(dy)
    for i in sample_images(batch, channels * hw * hw):
        x32 = x.detach()[i:i + 1].float().requires_grad_()
        ref = F.avg_pool2d(x32, 3, 1, 1)
        ref.backward(dy[i:i + 1].float())
        assert_close(y[i:i + 1], ref, tol=TOL)
        assert_close(x.grad[i:i + 1], x32.grad, tol=TOL)


@gpu
def test_avg_pool2d_past_2_31_elements(memory_budget):
    channels = 32
    check_avg_pool2d(batch_past_limit(channels), channels, HW)


# ---------------------------------------------------------------- batch_norm

def check_batch_norm(batch, channels, hw, training):
    eps, momentum = 1e-5, 0.1
    x = leaf(bf16_randn(batch, channels, hw, hw, seed=0) * 2 + 1)
    weight = leaf(torch.linspace(0.5, 1.5, channels, device=DEVICE))
    bias = leaf(torch.linspace(-1, 1, channels, device=DEVICE))
    running_mean = torch.linspace(-0.5, 0.5, channels, device=DEVICE)
    running_var = torch.linspace(0.5, 2.0, channels, device=DEVICE)
    start_mean, start_var = running_mean.clone(), running_var.clone()
    y = batch_norm(x, running_mean, running_var, weight, bias, training=training, momentum=momentum, eps=eps)
    dy = bf16_randn(*y.shape, seed=3)
    y.backward(dy)

    count = batch * hw * hw
    per_image = channels * hw * hw
    xd = x.detach()
    if training:
        mean = channel_sums(lambda p: xd[p].double(), batch, per_image) / count
        var = channel_sums(lambda p: (xd[p].double() - mean.view(1, -1, 1, 1)) ** 2, batch, per_image) / count
        assert_close(running_mean, (1 - momentum) * start_mean.double() + momentum * mean, tol=1e-5)
        assert_close(running_var, (1 - momentum) * start_var.double() + momentum * var * count / (count - 1), tol=1e-5)
    else:
        mean, var = start_mean.double(), start_var.double()
        assert torch.equal(running_mean, start_mean) and torch.equal(running_var, start_var)
    rstd = (var + eps).rsqrt()
    shape = (1, -1, 1, 1)
    sum_dy = channel_sums(lambda p: dy[p].double(), batch, per_image)
    sum_dy_xmu = channel_sums(lambda p: dy[p].double() * (xd[p].double() - mean.view(shape)), batch, per_image)
    assert_close(bias.grad, sum_dy, tol=TOL)
    assert_close(weight.grad, sum_dy_xmu * rstd, tol=TOL)
    w64 = weight.detach().double()
    for i in sample_images(batch, per_image):
        xhat = (xd[i:i + 1].double() - mean.view(shape)) * rstd.view(shape)
        assert_close(y[i:i + 1], xhat * w64.view(shape) + bias.detach().double().view(shape), tol=TOL)
        dyi = dy[i:i + 1].double()
        if training:
            dx_ref = (w64 * rstd).view(shape) * (dyi - (sum_dy / count).view(shape)
                                                 - xhat * (sum_dy_xmu * rstd / count).view(shape))
        else:
            dx_ref = (w64 * rstd).view(shape) * dyi
        assert_close(x.grad[i:i + 1], dx_ref, tol=TOL)


@gpu
@pytest.mark.parametrize("channels, training", [
    pytest.param(32, True, id="train"),
    pytest.param(32, False, id="eval"),
    # One channel: its B*HW values themselves number more than 2**31 (counts and sums must not wrap).
    pytest.param(1, True, id="train-one-channel"),
])
def test_batch_norm_past_2_31_elements(channels, training, memory_budget):
    check_batch_norm(batch_past_limit(channels), channels, HW, training)


# ---------------------------------------------------------------- the dry run

@pytest.mark.skipif(not INTERPRETED, reason="the dry run is for the CPU; the GPU runs the large tests above")
def test_dry_run_on_tiny_shapes(memory_budget):
    check_conv2d(3, 3, 4, 3, 2, 1, 1, hw=5)
    check_conv2d(2, 3, 3, 3, 1, 1, 3, hw=4)
    check_conv2d(2, 3, 4, 1, 1, 0, 1, hw=4)
    check_conv2d_in_a_child(2, *ONE_CHANNEL_CONV, 4)
    check_avg_pool2d(3, 2, hw=5)
    for channels, training in ((2, True), (2, False), (1, True)):
        check_batch_norm(3, channels, hw=4, training=training)
