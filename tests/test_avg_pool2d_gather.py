"""The gather avg-pool kernels against torch.nn.functional.avg_pool2d in float64, every option."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nnkernels.kernel import catalogue
from nnkernels.ops.avg_pool2d.gather import (
    AvgPool2dGatherBackward,
    AvgPool2dGatherForward,
    contiguous_row_align,
    pooled_size,
    row_align,
    uniform_divisor,
)
from nnkernels.functional.pooling_algorithms import gather_config, pooling_blocks
from nnkernels.machine import INTERPRETER
from support import DEVICE, DTYPES, GPU, assert_close, gpu, poisoned, randn

# (B, C, H, W, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
CASES = [
    (2, 3, 8, 8, (2, 2), (2, 2), (0, 0), False, True, None),  # the common k2 s2
    (1, 2, 7, 9, (3, 3), (1, 1), (1, 1), False, True, None),  # k3 s1 p1, every window full with padding
    (1, 2, 7, 9, (3, 3), (1, 1), (1, 1), False, False, None),  # padding left out of the divisor
    (2, 2, 8, 7, (3, 3), (2, 2), (0, 0), True, True, None),  # ceil_mode: last windows overhang the image
    (1, 3, 9, 8, (3, 2), (2, 3), (1, 1), True, False, None),  # rectangular, overhang, padding not counted
    (1, 2, 9, 9, (4, 4), (3, 3), (2, 2), True, True, None),  # overhang past the padding: clipped divisor
    (1, 2, 6, 7, (3, 3), (2, 2), (1, 1), False, True, 5),  # divisor_override
    (1, 2, 7, 7, (2, 2), (3, 3), (1, 0), False, True, None),  # stride > kernel: some dx covered by no window
    (1, 2, 7, 9, (3, 2), (2, 2), (1, 0), False, False, None),  # contiguous rows, odd width, padded rows
]


def _kernels(cls, x_shape, y_shape, kernel, stride, padding, cip, divisor, dtype):
    H, W = x_shape[2:]
    OH, OW = y_shape[2:]
    options = SimpleNamespace(kh=kernel[0], kw=kernel[1], stride_h=stride[0], stride_w=stride[1], pad_h=padding[0],
                              pad_w=padding[1], count_include_pad=cip, divisor_override=divisor or 0)
    uniform = uniform_divisor(options, H, W, OH, OW)
    backward = cls is AvgPool2dGatherBackward
    rows, cols = (x_shape[0] * x_shape[1] * H, W) if backward else (x_shape[0] * x_shape[1] * OH, OW)
    x_align = () if backward else (contiguous_row_align(options, W, OW),)
    return cls(*kernel, *stride, *padding, cip, divisor or 0, uniform, row_align(cols), *x_align,
               *pooling_blocks(rows, cols, INTERPRETER if DEVICE == "cpu" else GPU), dtype=dtype)


# Every case in fp32; the element types only change loads and stores, so two cases cover fp16/bf16.
CASES_BY_DTYPE = [(case, torch.float32) for case in CASES] + [
    (case, dtype) for dtype in DTYPES[1:] for case in (CASES[1], CASES[4])]


@pytest.mark.parametrize("case, dtype", CASES_BY_DTYPE,
                         ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else "-".join(
                             map(str, v[4:])))
def test_forward_and_backward_match_pytorch(case, dtype):
    B, C, H, W, kernel, stride, padding, ceil_mode, cip, divisor = case
    x = randn(B, C, H, W, dtype=dtype)
    x64 = x.to(torch.float64).requires_grad_()
    ref = F.avg_pool2d(x64, kernel, stride, padding, ceil_mode, cip, divisor)
    OH, OW = ref.shape[2:]
    assert (OH, OW) == (pooled_size(H, kernel[0], stride[0], padding[0], ceil_mode),
                        pooled_size(W, kernel[1], stride[1], padding[1], ceil_mode))
    y = poisoned(B, C, OH, OW, dtype=dtype)
    forward = _kernels(AvgPool2dGatherForward, x.shape, ref.shape, kernel, stride, padding, cip, divisor, dtype)
    forward.launch(x, y, B * C, H, W, OH, OW)
    assert_close(y, ref, dtype)

    dy = randn(B, C, OH, OW, dtype=dtype)
    ref.backward(dy.to(torch.float64))
    dx = poisoned(B, C, H, W, dtype=dtype)
    backward = _kernels(AvgPool2dGatherBackward, x.shape, ref.shape, kernel, stride, padding, cip, divisor, dtype)
    backward.launch(dy, dx, B * C, H, W, OH, OW)
    assert_close(dx, x64.grad, dtype)


def test_many_planes_per_program_and_ragged_tiles():
    """Tiles that span several planes and end mid-plane, in both kernels (fp32, 5x5 planes)."""
    B, C, H, W = 3, 5, 5, 5
    x = randn(B, C, H, W)
    x64 = x.to(torch.float64).requires_grad_()
    ref = F.avg_pool2d(x64, 3, 2, 1, True, False)
    OH, OW = ref.shape[2:]
    y = poisoned(B, C, OH, OW)
    AvgPool2dGatherForward(3, 3, 2, 2, 1, 1, False, 0, False, 1, 0, 8, 2).launch(x, y, B * C, H, W, OH, OW)
    assert_close(y, ref)
    dy = randn(B, C, OH, OW)
    ref.backward(dy.to(torch.float64))
    dx = poisoned(B, C, H, W)
    AvgPool2dGatherBackward(3, 3, 2, 2, 1, 1, False, 0, False, 1, 16, 4).launch(dy, dx, B * C, H, W, OH, OW)
    assert_close(dx, x64.grad)


def test_bad_launch_raises_and_writes_nothing():
    x = randn(1, 2, 6, 6)
    y = poisoned(1, 2, 3, 3)
    forward = AvgPool2dGatherForward(2, 2, 2, 2, 0, 0, True, 0, True, 1, 2, 16, 4)
    with pytest.raises(ValueError, match="OH"):
        forward.launch(x, y, 2, 6, 6, 4, 3)
    with pytest.raises(ValueError, match="y"):
        forward.launch(x, poisoned(1, 2, 3, 2), 2, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="uniform"):
        AvgPool2dGatherForward(2, 2, 2, 2, 0, 0, True, 0, False, 1, 2, 16, 4).launch(x, y, 2, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="pad_h"):
        AvgPool2dGatherForward(2, 2, 2, 2, 2, 0, True, 0, False, 1, 2, 16, 4).launch(x, y, 2, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="row_align"):
        AvgPool2dGatherForward(2, 2, 2, 2, 0, 0, True, 0, True, 2, 2, 16, 4).launch(x, y, 2, 6, 6, 3, 3)
    with pytest.raises(ValueError, match="x_align"):
        AvgPool2dGatherForward(2, 2, 2, 2, 0, 0, True, 0, True, 1, 4, 16, 4).launch(x, y, 2, 6, 6, 3, 3)
    with pytest.raises(TypeError, match="count_include_pad"):
        AvgPool2dGatherForward(2, 2, 2, 2, 0, 0, 1, 0, True, 1, 0, 16, 4)
    assert torch.isnan(y).all()


def test_catalogue_keeps_the_seeds_beside_the_gather_kernels():
    names = [cls.__name__ for cls in catalogue()]
    for name in ("Avgpool2dForward", "Avgpool2dBackward", "AvgPool2dGatherForward", "AvgPool2dGatherBackward"):
        assert name in names


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_suite_shape_on_gpu_is_deterministic_and_correct(dtype):
    """k3 s1 p1 on B8 C64 56x56 (overlapping windows): bitwise equal twice, and equal to PyTorch."""
    x = torch.randn(8, 64, 56, 56, device=DEVICE, dtype=dtype)
    dy = torch.randn(8, 64, 56, 56, device=DEVICE, dtype=dtype)
    config = gather_config(8 * 64 * 56, 56, 9, GPU)
    kernel = AvgPool2dGatherBackward(3, 3, 1, 1, 1, 1, True, 0, True, row_align(56), config.block_r, config.block_w,
                                     dtype=dtype, num_warps=config.num_warps)
    first, second = poisoned(*x.shape, dtype=dtype), poisoned(*x.shape, dtype=dtype)
    kernel.launch(dy, first, 8 * 64, 56, 56, 56, 56)
    kernel.launch(dy, second, 8 * 64, 56, 56, 56, 56)
    assert torch.equal(first, second)
    x64 = x.double().requires_grad_()
    F.avg_pool2d(x64, 3, 1, 1).backward(dy.double())
    assert_close(first, x64.grad, dtype)
