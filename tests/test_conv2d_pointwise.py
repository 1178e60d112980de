"""The 1x1 kernels with small tiles, so that every tail (channels, pixels, K slices, split) is
exercised on the interpreter too, against PyTorch in float64."""
import pytest
import torch
import torch.nn.functional as F
from support import CONV_TF32_TOLERANCE, DEVICE, DTYPES, assert_close, dtype_id, poisoned, randn

from nnkernels.ops.conv2d.partials import Conv2dDwReduce
from nnkernels.ops.conv2d.pointwise import Conv2dPointwise, Conv2dPointwiseDw

B, C_IN, C_OUT, H, W = 3, 40, 24, 5, 7  # no size a multiple of the 16-wide tiles
INF, NAN = float("inf"), float("nan")


def reference(x, w, b, dy):
    x64, w64, b64 = (t.cpu().double().requires_grad_() for t in (x, w, b))
    y64 = F.conv2d(x64, w64, b64)
    y64.backward(dy.cpu().double())
    return y64, x64.grad, w64.grad, b64.grad


# K in 16-channel slices, one channel tile per program; or the whole reduction as one x tile (block_k 64 >=
# 40 and 24 channels) serving 2 channel tiles per program (the last program's second tile past C_OUT or C_IN).
TILINGS = {"k-slices": dict(block_m=16, block_n=16, block_k=16, m_tiles=0),
           "whole-k": dict(block_m=16, block_n=16, block_k=64, m_tiles=2)}


def ragged_case(dtype):
    """x, w, b, dy of the ragged sizes above and torch's float64 (y, dx, dw, dbias)."""
    x, w, b = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, 1, 1, dtype=dtype), randn(C_OUT, dtype=dtype)
    dy = randn(B, C_OUT, H, W, dtype=dtype)
    return (x, w, b, dy), reference(x, w, b, dy)


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_pointwise_forward_and_dx_over_ragged_tiles(dtype, tiling):
    (x, w, b, dy), (y64, dx64, _, _) = ragged_case(dtype)
    tiles = TILINGS[tiling]

    y = poisoned(B, C_OUT, H, W, dtype=dtype)
    Conv2dPointwise(has_bias=True, tf32=False, w_transposed=False, **tiles, dtype=dtype).launch(
        x, w, b, y, B, C_IN, C_OUT, H * W)
    assert_close(y, y64, dtype)

    # dx reads the forward's weight transposed; the same as a product with a transposed copy, bitwise
    dx, dx_copied = poisoned(B, C_IN, H, W, dtype=dtype), poisoned(B, C_IN, H, W, dtype=dtype)
    Conv2dPointwise(has_bias=False, tf32=False, w_transposed=True, **tiles, dtype=dtype).launch(
        dy, w, dx, dx, B, C_OUT, C_IN, H * W)
    assert_close(dx, dx64, dtype)
    w_t = w.reshape(C_OUT, C_IN).t().contiguous()
    Conv2dPointwise(has_bias=False, tf32=False, w_transposed=False, **tiles, dtype=dtype).launch(
        dy, w_t, dx_copied, dx_copied, B, C_OUT, C_IN, H * W)
    assert torch.equal(dx, dx_copied)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_pointwise_dw_over_ragged_tiles(dtype):
    (x, _, _, dy), (_, _, dw64, db64) = ragged_case(dtype)
    split = 4  # 3 images x cdiv(35, 16) = 9 steps in 4 slices: the last slice is short
    partial = poisoned(split, C_OUT * C_IN + C_OUT, dtype=torch.float32)
    Conv2dPointwiseDw(has_bias=True, tf32=False, block_m=16, block_n=16, block_k=16, dtype=dtype).launch(
        dy, x, partial, B, C_IN, C_OUT, H * W, split
    )
    dw, db = poisoned(C_OUT, C_IN, 1, 1, dtype=dtype), poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(True, 1, 1, 8, 256, dtype=dtype).launch(partial, dw, db, split, C_OUT * C_IN, C_OUT)
    assert_close(dw, dw64, dtype)
    assert_close(db, db64, dtype)


@pytest.mark.parametrize("tiling", TILINGS)
def test_pointwise_fp32_with_tf32_over_ragged_tiles(tiling):
    """With TF32 allowed, fp32 runs TF32 products (`pointwise_tf32_product`): forward with bias and dx
    within TF32's error."""
    x, w, b = randn(B, C_IN, H, W), randn(C_OUT, C_IN, 1, 1), randn(C_OUT)
    dy = randn(B, C_OUT, H, W)
    y64, dx64, _, _ = reference(x, w, b, dy)
    tiles = TILINGS[tiling]
    y = poisoned(B, C_OUT, H, W)
    Conv2dPointwise(has_bias=True, tf32=True, w_transposed=False, **tiles).launch(x, w, b, y, B, C_IN, C_OUT, H * W)
    assert_close(y, y64, tol=CONV_TF32_TOLERANCE)
    dx = poisoned(B, C_IN, H, W)
    Conv2dPointwise(has_bias=False, tf32=True, w_transposed=True, **tiles).launch(dy, w, dx, dx, B, C_OUT, C_IN, H * W)
    assert_close(dx, dx64, tol=CONV_TF32_TOLERANCE)


@pytest.mark.parametrize("tiling", TILINGS)
def test_pointwise_tf32_rounds_x_to_nearest(tiling):
    """One product per pixel with w = 1 + 2^-10 (a TF32 value), so y shows exactly what x became: rounded
    to TF32's 10 mantissa bits, to nearest with ties away from zero (truncation would give 1 for
    1 + 3*2^-12), Inf and NaN kept."""
    step = 2.0 ** -10  # TF32's spacing in [1, 2)
    x = torch.tensor([1 + 0.75 * step, -(1 + 0.75 * step), 1 + 0.5 * step, 1 + 0.25 * step, INF, -INF, NAN],
                     device=DEVICE).reshape(1, 1, 1, 7)
    w = torch.full((1, 1), 1 + step, device=DEVICE)
    y = poisoned(1, 1, 1, 7)
    Conv2dPointwise(False, True, False, **TILINGS[tiling]).launch(x, w, y, y, 1, 1, 1, 7)
    rounded_x = torch.tensor([1 + step, -(1 + step), 1 + step, 1.0, INF, -INF, NAN])
    expected = (rounded_x * (1 + step)).reshape(1, 1, 1, 7)
    assert torch.equal(y.cpu().isnan(), expected.isnan())
    assert torch.equal(y.cpu().nan_to_num(), expected.nan_to_num())


def test_pointwise_whole_k_refuses_a_longer_reduction():
    """With m_tiles the reduction must fit the one x tile: 40 channels into 32 refused, nothing written."""
    x, w, y = randn(1, 40, 2, 2), randn(8, 40), poisoned(1, 8, 2, 2)
    with pytest.raises(ValueError, match="C_IN: expected at most block_k = 32"):
        Conv2dPointwise(False, False, False, 16, 16, 32, 1).launch(x, w, y, y, 1, 40, 8, 4)
    assert torch.isnan(y).all()


def test_pointwise_refuses_a_split_longer_than_the_pixels():
    x, dy = randn(1, 4, 2, 2), randn(1, 4, 2, 2)
    partial = poisoned(3, 16)
    with pytest.raises(ValueError, match=r"SPLIT: expected at most B\*cdiv\(HW, block_k\) = 1 slices, got 3"):
        Conv2dPointwiseDw(False, False, 16, 16, 16).launch(dy, x, partial, 1, 4, 4, 4, 3)
    assert torch.isnan(partial).all()
