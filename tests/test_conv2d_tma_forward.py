"""The TMA-box convolution forward (`Conv2dTmaForward`), launched directly.

References: torch's convolution in float64 on the same data; outputs and partials poisoned with NaN
before launch. Boxes that divide neither the output's rows nor its columns nor the batch, and channel
tiles wider than the channels, so every edge of a box and of a tile is ragged; boxes starting in the
padding (the TMA's zero fill stands for it) and running past the input; strides 2 and 3 (x viewed by phases),
with paddings that reach back one phase row or more.
"""
import pytest
import torch

from nnkernels.ops.conv2d.partials import Conv2dDwReduce
from nnkernels.ops.conv2d.tma_forward import Conv2dTmaForward
from support import (CONV_TF32_TOLERANCE, DTYPES, TOLERANCE, assert_close, conv_output_sizes, dtype_id, gpu, poisoned,
                     randn)

# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation, box (BOX_B, BOX_H, BOX_W))
CASES = [
    pytest.param((3, 16, 24, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), (1, 4, 4)), id="3x3-pad1-ragged-boxes"),
    pytest.param((3, 32, 16, 5, 5, 3, 3, (1, 1), (1, 1), (1, 1), (2, 8, 8)), id="two-images-per-box"),
    pytest.param((2, 16, 16, 9, 7, 3, 2, (1, 1), (2, 0), (2, 1), (1, 2, 8)), id="rect-dilated-unpadded-columns"),
    pytest.param((2, 16, 40, 6, 5, 1, 1, (1, 1), (0, 0), (1, 1), (1, 8, 4)), id="1x1"),
    pytest.param((2, 16, 16, 8, 8, 5, 5, (1, 1), (4, 4), (1, 1), (1, 4, 8)), id="5x5-pad4-taps-on-padding-only"),
    pytest.param((3, 16, 24, 10, 6, 3, 3, (2, 2), (1, 1), (1, 1), (1, 4, 4)), id="3x3-stride2-pad1"),
    pytest.param((2, 16, 40, 8, 8, 1, 1, (2, 2), (0, 0), (1, 1), (2, 2, 4)), id="1x1-stride2"),
    pytest.param((1, 16, 16, 9, 8, 3, 3, (3, 2), (2, 1), (1, 2), (1, 2, 8)), id="strides-3-2-dilated"),
    pytest.param((2, 16, 16, 12, 12, 7, 7, (2, 2), (3, 3), (1, 1), (1, 4, 4)), id="7x7-stride2-pad3"),
]


def _forward(case, dtype, *, bias=True, split=1, flip=False, tf32=False, blocks=(16, 16), y_nhwc=False):
    """(y from Conv2dTmaForward [+ the ordered split sum], NHWC storage with `y_nhwc`; torch's float64 y)."""
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil, box = case
    OH, OW = conv_output_sizes((H, W), (KH, KW), stride, pad, dil)
    x, w = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, KH, KW, dtype=dtype)
    b = randn(C_OUT, dtype=dtype) if bias else None
    x_cl = x.permute(0, 2, 3, 1).contiguous()
    w_cl = (w.flip(2, 3) if flip else w).permute(0, 2, 3, 1).contiguous()
    y = poisoned(B, OH, OW, C_OUT, dtype=dtype) if y_nhwc else poisoned(B, C_OUT, OH, OW, dtype=dtype)
    partial = poisoned(split, y.numel()) if split > 1 else torch.empty(0, device=x.device)
    kernel = Conv2dTmaForward(KH, KW, *stride, *pad, *dil, bias, tf32, flip, y_nhwc, *box, *blocks, split,
                              dtype=dtype)
    kernel.launch(x_cl, w_cl, b if bias else y, y, partial, B, C_IN, C_OUT, H, W, OH, OW)
    if split > 1:
        assert torch.isnan(y).all()  # the kernel writes only the partials
        Conv2dDwReduce(False, 1, 1, 4, 64, dtype=dtype).launch(partial, y, y, split, y.numel(), C_OUT)
    y = y.permute(0, 3, 1, 2) if y_nhwc else y
    b64 = b.double().cpu() if bias else None
    return y, torch.nn.functional.conv2d(x.double().cpu(), w.double().cpu(), b64, stride, pad, dil)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_tma_forward_matches_float64(case, dtype):
    y, ref = _forward(case, dtype)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("case", CASES[:4] + CASES[5:7])
def test_tma_forward_writes_nhwc(case):
    """Y_NHWC: the same y, stored [B, OH, OW, C_OUT]."""
    y, ref = _forward(case, torch.bfloat16, y_nhwc=True)
    assert_close(y, ref, torch.bfloat16)


@pytest.mark.parametrize("split, y_nhwc", [(2, False), (5, False), (5, True)],
                         ids=["2-slices", "5-ragged-slices", "5-slices-y-nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_tma_forward_split_over_k(dtype, split, y_nhwc):
    """9 taps x 32 channels in 18 K-steps of 16, in slices of fp32 partials (in y's layout) summed in order;
    bias in the first slice only."""
    y, ref = _forward(CASES[1].values[0], dtype, split=split, y_nhwc=y_nhwc)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_tma_forward_reads_flipped_taps(dtype):
    """FLIP_TAPS: w holds its taps in reverse (a 3x2 kernel, so each axis counts); y is the convolution with
    the weight before the flip (a stride-1 dx run as a forward)."""
    y, ref = _forward(CASES[2].values[0], dtype, flip=True, bias=False)
    assert_close(y, ref, dtype)


@gpu
def test_tma_forward_tf32_and_wide_tiles_on_the_gpu():
    """TF32 products within TF32's tolerance; channel tiles of 128 over 40 channels (ragged) and 64-pixel
    boxes, the GPU configs' shapes, with K slices of 32 fp32 channels."""
    case = (4, 64, 40, 14, 14, 3, 3, (1, 1), (1, 1), (1, 1), (1, 4, 16))
    y, ref = _forward(case, torch.float32, tf32=True, blocks=(128, 32))
    assert_close(y, ref, torch.float32, tol=CONV_TF32_TOLERANCE)
    y, ref = _forward(case, torch.float32, tf32=False, blocks=(128, 32), split=3)
    assert_close(y, ref, torch.float32, tol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("constants, sizes, match", [
    ((3, 3, 2, 2, 1, 1, 1, 1), (2, 16, 16, 7, 7, 4, 4), "H: expected a multiple of the stride 2"),
    ((3, 3, 1, 1, 1, 1, 1, 1), (2, 24, 16, 7, 7, 7, 7), "C_IN: expected a multiple of block_k"),
    ((3, 3, 1, 1, 1, 1, 1, 1), (2, 6, 16, 7, 7, 7, 7), "C_IN: expected a multiple of 4"),
], ids=["stride-not-dividing-the-plane", "channels-not-in-k-slices", "rows-not-16-bytes"])
def test_tma_forward_refuses_what_it_cannot_run(constants, sizes, match):
    """Refused before launch, nothing written."""
    B, C_IN, C_OUT, H, W, OH, OW = sizes
    x_cl, w_cl = randn(B, H, W, C_IN), randn(C_OUT, 3, 3, C_IN)
    y = poisoned(B, C_OUT, OH, OW)
    kernel = Conv2dTmaForward(*constants, False, False, False, False, 1, 4, 4, 16, 16, 1)
    with pytest.raises(ValueError, match=match):
        kernel.launch(x_cl, w_cl, y, y, torch.empty(0, device=x_cl.device), *sizes)
    assert torch.isnan(y).all()
