"""Average pooling on channels-last tensors: the channels-last kernels launched directly (outputs poisoned, every
option, tiles that divide neither the pixels nor the channels), and `avg_pool2d` on channels-last tensors, which
reads and writes them where they lie.

References: torch's avg_pool2d and its autograd in float64 on the same data.
"""
import pytest
import torch
import torch.nn.functional as F

from nnkernels.functional import avg_pool2d
from nnkernels.functional.common import last_kernels
from nnkernels.functional.nhwc_tiles import nhwc_tiles
from nnkernels.machine import INTERPRETER
from nnkernels.ops.avg_pool2d.channels_last import AvgPool2dClBackward, AvgPool2dClForward
from nnkernels.ops.avg_pool2d.gather import uniform_divisor
from nnkernels.ops.common.host_math import channel_alignment
from support import DEVICE, DTYPES, GPU, assert_close, dtype_id, gpu, poisoned, randn
from test_avg_pool2d_gather import CASES

CL = torch.channels_last


def _stored(t):
    return t.permute(0, 2, 3, 1)


def _options(case, H, W, OH, OW):
    _, _, _, _, kernel, stride, padding, _, cip, divisor = case
    window = dict(kh=kernel[0], kw=kernel[1], stride_h=stride[0], stride_w=stride[1], pad_h=padding[0],
                  pad_w=padding[1], count_include_pad=cip, divisor_override=divisor or 0)
    uniform = uniform_divisor(type("Window", (), window), H, W, OH, OW)
    return (*kernel, *stride, *padding, cip, divisor or 0, uniform)


def _run_both(case, dtype, block_p, block_c):
    """((y, y64), (dx, dx64)): both kernels launched on channels-last tensors, tile BLOCK_P x BLOCK_C, the
    channels' vector alignment as the plans set it (`channel_alignment`)."""
    B, C, H, W, kernel, stride, padding, ceil_mode, cip, divisor = case
    x = randn(B, C, H, W, dtype=dtype).contiguous(memory_format=CL)
    x64 = x.double().cpu().requires_grad_()
    y64 = F.avg_pool2d(x64, kernel, stride, padding, ceil_mode, cip, divisor)
    OH, OW = y64.shape[2:]
    options, sizes = _options(case, H, W, OH, OW), (B, C, H, W, OH, OW)
    c_align = channel_alignment(C, x.element_size())
    y = poisoned(B, C, OH, OW, dtype=dtype).contiguous(memory_format=CL)
    AvgPool2dClForward(*options, block_p, block_c, c_align, dtype=dtype).launch(_stored(x), _stored(y), *sizes)
    dy = randn(B, C, OH, OW, dtype=dtype).contiguous(memory_format=CL)
    y64.backward(dy.double().cpu())
    dx = poisoned(B, C, H, W, dtype=dtype).contiguous(memory_format=CL)
    AvgPool2dClBackward(*options, block_p, block_c, c_align, dtype=dtype).launch(_stored(dy), _stored(dx), *sizes)
    return (y, y64), (dx, x64.grad)


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case[4:])))
def test_channels_last_kernels_match_float64_for_every_option(case):
    """Tiles of 8 pixels by 2 channels: ragged at the end of the pixels and, for 3 and 5 channels, of the channels."""
    for out, ref in _run_both(case, torch.float32, block_p=8, block_c=2):
        assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[4], (1, 24, 7, 9, (3, 3), (1, 1), (1, 1), False, True, None)],
                         ids=["k3-s1-p1", "rectangular-overhang", "24-channels-in-vectors-of-8"])
def test_channels_last_kernels_16bit(case, dtype):
    for out, ref in _run_both(case, dtype, block_p=16, block_c=4):
        assert_close(out, ref, dtype)


def test_every_result_is_the_same_bits_every_run():
    """The backward gathers in a fixed order (no atomics): two runs on the same data agree bit for bit."""
    def run():
        torch.manual_seed(3)
        return [out for out, _ in _run_both(CASES[5], torch.float32, block_p=8, block_c=2)]

    assert all(torch.equal(one, two) for one, two in zip(run(), run()))


def test_bad_launch_raises_and_writes_nothing():
    x = randn(1, 4, 6, 6).contiguous(memory_format=CL)
    y = poisoned(1, 4, 3, 3).contiguous(memory_format=CL)
    forward = AvgPool2dClForward(2, 2, 2, 2, 0, 0, True, 0, True, 8, 4, 4)
    with pytest.raises(ValueError, match="OH"):
        forward.launch(_stored(x), _stored(y), 1, 4, 6, 6, 4, 3)
    with pytest.raises(ValueError, match="y"):
        forward.launch(_stored(x), _stored(poisoned(1, 4, 3, 2)), 1, 4, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="uniform"):
        AvgPool2dClForward(2, 2, 2, 2, 0, 0, True, 0, False, 8, 4, 4).launch(_stored(x), _stored(y), 1, 4, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="pad_w"):
        AvgPool2dClForward(2, 2, 2, 2, 0, 2, True, 0, False, 8, 4, 4).launch(_stored(x), _stored(y), 1, 4, 6, 6, 3, 3)
    with pytest.raises(TypeError, match="count_include_pad"):
        AvgPool2dClForward(2, 2, 2, 2, 0, 0, 1, 0, True, 8, 4, 4)
    with pytest.raises(ValueError, match="C_ALIGN: expected a power of two dividing C = 4, got 8"):
        AvgPool2dClForward(2, 2, 2, 2, 0, 0, True, 0, True, 8, 4, 8).launch(_stored(x), _stored(y), 1, 4, 6, 6, 3, 3)
    assert torch.isnan(y).all()


@pytest.mark.parametrize("channels, widths", [(5, [8]), (256, [64]), (2048, [64]), (120, [64]), (72, [16, 64]),
                                              (200, [32, 64]), (40, [16, 64]), (24, [8, 32]), (16, [16]),
                                              (80, [32, 64]), (112, [64])])
def test_candidates_leave_few_channels_idle_and_stay_within_the_pixels(channels, widths):
    """Channel tiles: first the widest (up to 64) whose tiles leave at most a quarter of the channels idle (else
    8), then as wide as the channels, so that quick tuning (three candidates) times both; the interpreter takes
    the first; the pixel tile no wider than the pixels."""
    for pixels in (3, 49, 100_000):
        for machine in (GPU, INTERPRETER):
            configs = nhwc_tiles(pixels, channels, machine)
            assert configs and len(set(configs)) == len(configs)
            assert [c.block_c for c in configs[:len(widths)]] == (widths if machine.gpu else widths[:1])
            assert {c.block_c for c in configs} == set(widths if machine.gpu else widths[:1])
            for config in configs:
                assert config.block_p <= max(1, 2 ** (pixels - 1).bit_length())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=["k2-s2", "ceil-mode", "divisor-override"])
def test_avg_pool2d_reads_and_writes_channels_last_in_place(case, dtype):
    """No layout copy either way: y and dx channels-last as torch gives them, from the channels-last kernels."""
    B, C, H, W, kernel, stride, padding, ceil_mode, cip, divisor = case
    x = randn(B, C, H, W, dtype=dtype).contiguous(memory_format=CL).requires_grad_()
    y = avg_pool2d(x, kernel, stride, padding, ceil_mode, cip, divisor)
    dy = randn(*y.shape, dtype=dtype).contiguous(memory_format=CL)
    (dx,) = torch.autograd.grad(y, x, dy)
    launched = last_kernels("avg_pool2d")
    assert [k.split("__")[0] for k in launched["forward"] + launched["backward"]] == [
        "avg_pool2d_cl_forward", "avg_pool2d_cl_backward"]
    assert y.is_contiguous(memory_format=CL) and not y.is_contiguous()
    assert dx.is_contiguous(memory_format=CL) and not dx.is_contiguous()
    # The reference on the CPU: torch 2.11's CUDA channels-last backward is wrong where padding > 0
    # (pytorch/pytorch#188344).
    x64 = x.detach().double().cpu().requires_grad_()
    y64 = F.avg_pool2d(x64, kernel, stride, padding, ceil_mode, cip, divisor)
    y64.backward(dy.double().cpu())
    assert_close(y, y64, dtype)
    assert_close(dx, x64.grad, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_densenet_transition_on_gpu_is_deterministic_and_correct(dtype):
    """DenseNet's transition pool (k2 s2 on B32 C128 56x56) channels-last: bitwise equal twice, equal to torch."""
    x = torch.randn(32, 128, 56, 56, device=DEVICE, dtype=dtype).contiguous(memory_format=CL).requires_grad_()
    y = avg_pool2d(x, 2)
    dy = torch.randn_like(y)
    first, second = (torch.autograd.grad(avg_pool2d(x, 2), x, dy)[0] for _ in range(2))
    assert torch.equal(first, second)
    x64 = x.detach().double().requires_grad_()
    F.avg_pool2d(x64, 2).backward(dy.double())
    assert_close(y, F.avg_pool2d(x64.detach(), 2), dtype)
    assert_close(first, x64.grad, dtype)
