"""`Conv2dRowsForward` (the forward of few input channels, one output row per program), launched directly.

References are torch's convolution in float64 on the same data; y is poisoned with NaN before launch.
Column tiles narrower than the rows and K slices shorter than C_IN*KH rows leave ragged last tiles on
both axes; taps are padded to a power of two (KW = 7 -> 8, 5 -> 8, 3 -> 4).
"""
import pytest
import torch

from nnkernels.ops.conv2d.rows_forward import Conv2dRowsForward
from support import CONV_TF32_TOLERANCE, DTYPES, assert_close, dtype_id, gpu, poisoned, randn

# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation, bias)
CASES = [
    pytest.param((2, 3, 20, 19, 23, 7, 7, (2, 2), (3, 3), (1, 1), True), id="stem-7x7-s2"),
    pytest.param((1, 2, 9, 9, 11, 3, 5, (1, 1), (1, 2), (2, 1), False), id="rect-dil21"),
    pytest.param((2, 4, 5, 6, 34, 1, 3, (1, 2), (0, 1), (1, 1), True), id="1x3-stride12"),
    pytest.param((1, 1, 3, 8, 8, 8, 8, (1, 1), (0, 0), (1, 1), False), id="window-whole-plane"),
]


def _launch(case, dtype, tf32, block_m=16, block_n=16, rows_per_slice=2):
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil, has_bias = case
    x = randn(B, C_IN, H, W, dtype=dtype)
    w = randn(C_OUT, C_IN, KH, KW, dtype=dtype)
    bias = randn(C_OUT, dtype=dtype) if has_bias else None
    ref = torch.nn.functional.conv2d(x.double().cpu(), w.double().cpu(), None if bias is None else bias.double().cpu(),
                                     stride, pad, dil)
    y = poisoned(*ref.shape, dtype=dtype)
    span = 1 << (KW - 1).bit_length()
    kernel = Conv2dRowsForward(KH, KW, *stride, *pad, *dil, has_bias, tf32, block_m, block_n,
                               max(16, span * rows_per_slice), span, dtype=dtype)
    kernel.launch(x, w, y if bias is None else bias, y, B, C_IN, C_OUT, H, W, *ref.shape[2:])
    return y, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_rows_forward_matches_float64(case, dtype):
    y, ref = _launch(case, dtype, tf32=False)
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("case", CASES)
def test_rows_forward_tf32(case):
    y, ref = _launch(case, torch.float32, tf32=True)
    assert_close(y, ref, tol=CONV_TF32_TOLERANCE)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rows_forward_gpu_tiles(dtype):
    """The GPU's tiles: a 128-column tile over 112 columns, 4 rows of 8 taps a K slice, the stem's channels."""
    case = (2, 3, 64, 224, 224, 7, 7, (2, 2), (3, 3), (1, 1), True)
    y, ref = _launch(case, dtype, tf32=False, block_m=128, block_n=64, rows_per_slice=4)
    assert_close(y, ref, dtype)


def test_rows_forward_rejects_bad_tiles():
    x = randn(1, 3, 8, 8)
    y = poisoned(1, 4, 8, 8)
    w = randn(4, 3, 3, 3)
    with pytest.raises(ValueError, match="kw_span"):
        Conv2dRowsForward(3, 3, 1, 1, 1, 1, 1, 1, False, False, 16, 16, 16, 2).launch(x, w, y, y, 1, 3, 4, 8, 8, 8, 8)
    with pytest.raises(ValueError, match="block_k"):
        Conv2dRowsForward(3, 5, 1, 1, 1, 2, 1, 1, False, False, 16, 16, 20, 8).launch(x, w, y, y, 1, 3, 4, 8, 8, 8, 8)
    assert torch.isnan(y).all()


@pytest.mark.parametrize("dtype, tf32", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "mixed"], ids=["nan", "inf", "inf-and--inf"])
def test_rows_forward_special_values_like_float64(value, dtype, tf32):
    """NaN and Inf in x reach exactly the outputs whose windows cover them (full fp32's tf32x3 splits an Inf
    into a NaN remainder, which must not leak; padded taps and rows must not read them)."""
    B, C_IN, C_OUT, H, W = 1, 3, 16, 13, 15
    x = randn(B, C_IN, H, W, dtype=dtype)
    for (c, h, w), v in zip([(0, 0, 0), (1, 6, 14), (2, 12, 7)],
                            [value] * 3 if value != "mixed" else [float("inf"), float("-inf"), float("inf")]):
        x[0, c, h, w] = v
    w = randn(C_OUT, C_IN, 7, 7, dtype=dtype)
    ref = torch.nn.functional.conv2d(x.double().cpu(), w.double().cpu(), None, 2, 3)
    y = poisoned(*ref.shape, dtype=dtype)
    Conv2dRowsForward(7, 7, 2, 2, 3, 3, 1, 1, False, tf32, 16, 16, 16, 8, dtype=dtype).launch(
        x, w, y, y, B, C_IN, C_OUT, H, W, *ref.shape[2:])
    out = y.double().cpu()
    for name, kind in (("NaN", torch.isnan), ("+Inf", lambda t: t == float("inf")),
                       ("-Inf", lambda t: t == float("-inf"))):
        assert torch.equal(kind(out), kind(ref)), f"{name} at {int(kind(out).sum())} positions, float64 at " \
                                                  f"{int(kind(ref).sum())}"
    finite = torch.isfinite(ref)
    assert finite.any() and not finite.all()
    assert_close(out[finite], ref[finite], dtype, tol=CONV_TF32_TOLERANCE if tf32 else None)
