"""What a user coming from torch.nn.functional expects: errors torch code catches, eps, IEEE fp32 on the CPU,
meta tensors, and layers that print as nnkernels'."""
import pytest
import torch
import torch.nn.functional as F

import nnkernels
from support import DEVICE, assert_close, randn


@pytest.mark.parametrize("call", [
    lambda: nnkernels.conv2d(randn(1, 3, 5, 5), randn(4, 2, 3, 3)),  # channels
    lambda: nnkernels.conv2d(randn(1, 4, 5, 5), randn(6, 2, 3, 3), groups=4),  # groups
    lambda: nnkernels.conv2d(randn(1, 3, 2, 2), randn(4, 3, 3, 3)),  # kernel larger than the input
    lambda: nnkernels.avg_pool2d(randn(1, 2, 2, 2), 3),
    lambda: nnkernels.batch_norm(randn(2, 3, 4, 4), torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)),
], ids=["conv-channels", "conv-groups", "conv-kernel", "pool-kernel", "bn-channels"])
def test_mistakes_torch_reports_as_runtime_errors_are_runtime_errors_and_value_errors(call):
    with pytest.raises(RuntimeError) as caught:
        call()
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("eps", [0.0, -1e-5])
def test_batch_norm_training_refuses_eps_that_is_not_positive_and_writes_nothing(eps):
    running_mean, running_var = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"^eps: expected a float >"):
        nnkernels.batch_norm(randn(2, 3, 4, 4), running_mean, running_var, training=True, eps=eps)
    assert torch.equal(running_mean, torch.zeros(3, device=DEVICE)) and torch.equal(running_var, torch.ones(3,
                                                                                                        device=DEVICE))
    with pytest.raises(ValueError):
        torch.nn.functional.batch_norm(randn(2, 3, 4, 4), None, None, training=True, eps=eps)  # torch's too


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's fp32: the GPU follows cudnn.allow_tf32 as torch does")
def test_fp32_on_the_cpu_is_ieee_fp32_whatever_allow_tf32_says():
    """torch's CPU convolution never uses TF32; neither does ours (a 1x1 product's error was 2-3e-4 in TF32)."""
    x, w = randn(2, 64, 6, 6), randn(32, 64, 1, 1)
    with torch.backends.cudnn.flags(allow_tf32=True):
        y = nnkernels.conv2d(x, w)
    assert_close(y, F.conv2d(x.double(), w.double()), tol=1e-6)


def test_meta_tensors_give_torchs_shapes_forward_and_backward():
    x = torch.empty(2, 3, 9, 9, device="meta", requires_grad=True)
    w = torch.empty(8, 3, 3, 3, device="meta", requires_grad=True)
    y = nnkernels.conv2d(x, w, stride=2, padding=1)
    assert y.device.type == "meta" and y.shape == F.conv2d(x, w, stride=2, padding=1).shape
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                    torch.nn.AvgPool2d(2))
    model = nnkernels.convert(model)
    assert model(torch.empty(2, 3, 8, 8, device="meta")).shape == (2, 8, 4, 4)


def test_converted_layers_print_as_nnkernels_layers():
    model = nnkernels.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                                  torch.nn.AvgPool2d(2), torch.nn.ReLU()))
    text = str(model)
    assert "nnkernels.Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1))" in text
    assert "nnkernels.BatchNorm2d(4," in text and "nnkernels.AvgPool2d(kernel_size=2" in text
    assert "(3): ReLU()" in text
