"""The implicit-GEMM convolution kernels (forward, dx, dw + ordered reduce), launched directly.

References are torch's convolution in float64 on the same data. Outputs are poisoned with NaN
before launch, so an element a kernel does not write fails. Block sizes are set per case so that
no size is a multiple of any block (several programs per axis, ragged last tiles).
On the GPU fp32 runs with TF32 products (cuDNN's default) and with full fp32; TF32 needs a
looser tolerance (2e-3: 10-bit mantissa products) than full fp32 (1e-5).
"""
import pytest
import torch

from nnkernels.functional.conv_algorithms.base import GemmConfig
from nnkernels.functional.conv_algorithms.channels_last import channels_last_candidates, pixel_tiles
from nnkernels.ops.conv2d.channels_last import Conv2dGemmClDw, Conv2dGemmClForward
from nnkernels.ops.conv2d.channels_last_dx import Conv2dGemmClDx
from nnkernels.ops.conv2d.partials import Conv2dDwReduce, dw_partial_size
from nnkernels.ops.conv2d.gemm_dw import Conv2dGemmDw
from nnkernels.ops.conv2d.gemm_dx import Conv2dGemmDx
from nnkernels.ops.conv2d.gemm_forward import Conv2dGemmForward
from support import DEVICE, DTYPES, GPU, TOLERANCE, assert_close, gpu, poisoned, randn

TF32_TOLERANCE = 2e-3

# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation, groups, bias)
CASES = [
    pytest.param((2, 3, 5, 7, 9, 3, 3, (1, 1), (1, 1), (1, 1), 1, True), id="3x3-pad1-bias"),
    pytest.param((2, 4, 6, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), 2, True), id="3x3-stride2-groups2"),
    pytest.param((1, 5, 3, 10, 11, 3, 2, (2, 3), (2, 0), (2, 1), 1, False), id="rect-stride23-dil2"),
    pytest.param((2, 6, 4, 5, 7, 1, 1, (1, 1), (0, 0), (1, 1), 2, False), id="1x1-groups2"),
    pytest.param((1, 3, 5, 11, 10, 7, 7, (2, 2), (3, 3), (1, 1), 1, True), id="stem-7x7-s2"),
]


def _conv_sizes(B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil):
    OH = (H + 2 * pad[0] - dil[0] * (KH - 1) - 1) // stride[0] + 1
    OW = (W + 2 * pad[1] - dil[1] * (KW - 1) - 1) // stride[1] + 1
    return OH, OW


def _references(x, w, bias, dy, stride, pad, dil, groups):
    x64 = x.double().cpu().requires_grad_()
    w64 = w.double().cpu().requires_grad_()
    b64 = bias.double().cpu().requires_grad_() if bias is not None else None
    y64 = torch.nn.functional.conv2d(x64, w64, b64, stride, pad, dil, groups)
    y64.backward(dy.double().cpu())
    return y64.detach(), x64.grad, w64.grad, (b64.grad if b64 is not None else None)


def _run_all(case, dtype, tf32, blocks=(32, 16, 16), split=3):
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil, groups, has_bias = case
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil)
    x = randn(B, C_IN, H, W, dtype=dtype)
    w = randn(C_OUT, C_IN // groups, KH, KW, dtype=dtype)
    bias = randn(C_OUT, dtype=dtype) if has_bias else None
    dy = randn(B, C_OUT, OH, OW, dtype=dtype)
    geometry = (KH, KW, *stride, *pad, *dil, groups)
    sizes = (B, C_IN, C_OUT, H, W, OH, OW)
    y = poisoned(B, C_OUT, OH, OW, dtype=dtype)
    Conv2dGemmForward(*geometry, has_bias, tf32, *blocks, dtype=dtype).launch(
        x, w, bias if has_bias else y, y, *sizes
    )
    dx = poisoned(B, C_IN, H, W, dtype=dtype)
    Conv2dGemmDx(*geometry, tf32, *blocks, dtype=dtype).launch(dy, w, dx, *sizes)
    row = dw_partial_size(C_OUT, C_IN // groups, KH, KW, has_bias)
    partial = poisoned(split, row, dtype=torch.float32)
    Conv2dGemmDw(*geometry, has_bias, tf32, *blocks, dtype=dtype).launch(dy, x, partial, *sizes, split)
    dw = poisoned(C_OUT, C_IN // groups, KH, KW, dtype=dtype)
    dbias = poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(has_bias, 1, 1, 4, 64, dtype=dtype).launch(partial, dw, dbias if has_bias else dw, split,
                                                              dw.numel(), C_OUT)
    refs = _references(x, w, bias, dy, stride, pad, dil, groups)
    return (y, dx, dw, dbias if has_bias else None), refs


@pytest.mark.parametrize("case", CASES)
def test_gemm_kernels_match_float64_fp32(case):
    ours, refs = _run_all(case, torch.float32, tf32=False)
    for out, ref in zip(ours, refs):
        if ref is not None:
            assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_gemm_kernels_match_float64_16bit(case, dtype):
    ours, refs = _run_all(case, dtype, tf32=True)
    for out, ref in zip(ours, refs):
        if ref is not None:
            assert_close(out, ref, dtype)


def test_gemm_kernels_one_program_per_axis():
    """Blocks larger than every size (what the CPU heuristic picks): masks alone bound the tile."""
    ours, refs = _run_all(CASES[2].values[0], torch.float32, tf32=False, blocks=(256, 16, 64), split=1)
    for out, ref in zip(ours, refs):
        if ref is not None:
            assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("y_nhwc", [False, True], ids=["y-nchw", "y-nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_kernels_match_float64(dtype, y_nhwc):
    """Channels-last forward (y NCHW, or NHWC with Y_NHWC) and dw (groups = 1, channels multiples of the K/N
    blocks)."""
    B, C_IN, C_OUT, H, W, stride, pad, dil = 2, 32, 24, 7, 6, (2, 1), (1, 2), (1, 2)
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, 3, 3, stride, pad, dil)
    x, w, bias = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, 3, 3, dtype=dtype), randn(C_OUT, dtype=dtype)
    dy = randn(B, C_OUT, OH, OW, dtype=dtype)
    geometry = (3, 3, *stride, *pad, *dil)
    sizes = (B, C_IN, C_OUT, H, W, OH, OW)
    x_cl, w_cl, dy_cl = (t.permute(0, 2, 3, 1).contiguous() for t in (x, w, dy))
    stored = poisoned(B, OH, OW, C_OUT, dtype=dtype) if y_nhwc else poisoned(B, C_OUT, OH, OW, dtype=dtype)
    no_partial = torch.empty(0, device=x.device)
    Conv2dGemmClForward(*geometry, 1, True, True, False, False, y_nhwc, 32, 16, 16, 8, 1, 1, dtype=dtype).launch(
        x_cl, w_cl, bias, stored, no_partial, *sizes)
    y = stored.permute(0, 3, 1, 2) if y_nhwc else stored
    split = 3
    partial = poisoned(split, dw_partial_size(C_OUT, C_IN, 3, 3, True), dtype=torch.float32)
    Conv2dGemmClDw(*geometry, 1, True, True, False, 16, 16, 16, 1, 1, dtype=dtype).launch(dy_cl, x_cl, partial,
                                                                                         *sizes, split)
    dw, dbias = poisoned(C_OUT, C_IN, 3, 3, dtype=dtype), poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(True, 1, 1, 2, 64, dtype=dtype).launch(partial, dw, dbias, split, dw.numel(), C_OUT)
    y64, _, dw64, db64 = _references(x, w, bias, dy, stride, pad, dil, 1)
    for out, ref in ((y, y64), (dw, dw64), (dbias, db64)):
        assert_close(out, ref, dtype)
    with pytest.raises(ValueError, match="whole_windows: expected False"):
        Conv2dGemmClForward(*geometry, 1, True, True, False, False, y_nhwc, 32, 16, 64, 32, 1, 1, dtype=dtype).launch(
            x_cl, w_cl, bias, stored, no_partial, *sizes)


# (C_IN, C_OUT, C_ALIGN, split_k): channel counts that are no multiple of the 16-channel slices.
MASKED_SLICES = [
    pytest.param((24, 40, 8, 1), id="24-to-40-align8"),
    pytest.param((40, 24, 8, 3), id="40-to-24-align8-split3"),
    pytest.param((20, 12, 4, 1), id="20-to-12-align4"),
    pytest.param((5, 3, 1, 2), id="5-to-3-align1-split2"),
]


@pytest.mark.parametrize("y_nhwc", [False, True], ids=["y-nchw", "y-nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", MASKED_SLICES)
def test_channels_last_kernels_mask_the_last_slice_of_a_tap(channels, dtype, y_nhwc):
    """One group, WHOLE_WINDOWS off: forward (split over K too), dx and dw reduce over channel counts that 16-
    channel slices do not divide, the last slice of each tap masked, C_ALIGN what the launch tells the compiler."""
    C_IN, C_OUT, c_align, split_k = channels
    B, H, W, stride, pad, dil = 2, 7, 6, (2, 1), (1, 2), (1, 2)
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, 3, 3, stride, pad, dil)
    x, w, bias = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, 3, 3, dtype=dtype), randn(C_OUT, dtype=dtype)
    dy = randn(B, C_OUT, OH, OW, dtype=dtype)
    geometry, sizes = (3, 3, *stride, *pad, *dil), (B, C_IN, C_OUT, H, W, OH, OW)
    x_cl, w_cl, dy_cl = (t.permute(0, 2, 3, 1).contiguous() for t in (x, w, dy))
    stored = poisoned(B, OH, OW, C_OUT, dtype=dtype) if y_nhwc else poisoned(B, C_OUT, OH, OW, dtype=dtype)
    partial = poisoned(split_k, B * C_OUT * OH * OW) if split_k > 1 else torch.empty(0, device=x.device)
    forward = Conv2dGemmClForward(*geometry, 1, False, True, False, False, y_nhwc, 32, 16, 16, 8, split_k, c_align,
                                  dtype=dtype)
    forward.launch(x_cl, w_cl, bias, stored, partial, *sizes)
    if split_k > 1:
        Conv2dDwReduce(False, 1, 1, 4, 64, dtype=dtype).launch(partial, stored, stored, split_k, stored.numel(),
                                                               C_OUT)
    y = stored.permute(0, 3, 1, 2) if y_nhwc else stored
    dx = poisoned(B, H, W, C_IN, dtype=dtype)
    Conv2dGemmClDx(*geometry, 1, False, False, True, 32, 16, 16, 8, c_align, dtype=dtype).launch(
        dy_cl, w.permute(2, 3, 1, 0).contiguous(), dx, *sizes)
    split = 2
    dw_partial = poisoned(split, dw_partial_size(C_OUT, C_IN, 3, 3, True), dtype=torch.float32)
    Conv2dGemmClDw(*geometry, 1, False, True, False, 16, 16, 16, 1, c_align, dtype=dtype).launch(
        dy_cl, x_cl, dw_partial, *sizes, split)
    dw, dbias = poisoned(C_OUT, C_IN, 3, 3, dtype=dtype), poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(True, 1, 1, 2, 64, dtype=dtype).launch(dw_partial, dw, dbias, split, dw.numel(), C_OUT)
    y64, dx64, dw64, db64 = _references(x, w, bias, dy, stride, pad, dil, 1)
    for out, ref in ((y, y64), (dx.permute(0, 3, 1, 2), dx64), (dw, dw64), (dbias, db64)):
        assert_close(out, ref, dtype)


def test_channels_last_kernels_check_c_align():
    """A C_ALIGN that does not divide both channel counts is refused, naming it; nothing is written."""
    x, w = randn(1, 5, 5, 24), randn(40 * 9 * 24)
    y = poisoned(1, 40, 5, 5)
    wrong = Conv2dGemmClForward(3, 3, 1, 1, 1, 1, 1, 1, 1, False, False, False, False, False, 32, 16, 16, 32, 1, 16,
                                dtype=torch.float32)
    with pytest.raises(ValueError, match=r"C_ALIGN: expected a power of two dividing gcd\(C_IN/G, C_OUT/G\) = 8, "
                                         r"got 16"):
        wrong.launch(x, w, y, y, torch.empty(0, device=x.device), 1, 24, 40, 5, 5, 5, 5)
    assert torch.isnan(y).all()


@pytest.mark.parametrize("split_k, y_nhwc", [(2, False), (5, False), (18, False), (5, True)],
                         ids=["2-slices", "5-ragged-slices", "a-slice-per-step", "5-slices-y-nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_forward_split_over_k(dtype, split_k, y_nhwc):
    """The forward's K (9 taps x 32 channels: 18 steps of 16) in slices of fp32 partials (in y's layout), bias
    in the first only, summed in order by the reduce into y; y untouched by the kernel itself; too many
    slices refused."""
    B, C_IN, C_OUT, H, W, stride, pad, dil = 2, 32, 24, 7, 6, (1, 1), (1, 1), (1, 1)
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, 3, 3, stride, pad, dil)
    x, w, bias = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, 3, 3, dtype=dtype), randn(C_OUT, dtype=dtype)
    geometry, sizes = (3, 3, *stride, *pad, *dil), (B, C_IN, C_OUT, H, W, OH, OW)
    x_cl, w_cl = (t.permute(0, 2, 3, 1).contiguous() for t in (x, w))
    stored = poisoned(B, OH, OW, C_OUT, dtype=dtype) if y_nhwc else poisoned(B, C_OUT, OH, OW, dtype=dtype)
    partial = poisoned(split_k, B * C_OUT * OH * OW)
    Conv2dGemmClForward(*geometry, 1, True, True, False, False, y_nhwc, 32, 16, 16, 8, split_k, 1, dtype=dtype).launch(
        x_cl, w_cl, bias, stored, partial, *sizes)
    assert torch.isnan(stored).all()
    Conv2dDwReduce(False, 1, 1, 4, 64, dtype=dtype).launch(partial, stored, stored, split_k, stored.numel(), C_OUT)
    y = stored.permute(0, 3, 1, 2) if y_nhwc else stored
    assert_close(y, _references(x, w, bias, randn(*y.shape), stride, pad, dil, 1)[0], dtype)
    with pytest.raises(ValueError, match="split_k: expected at most the 18 K-steps"):
        Conv2dGemmClForward(*geometry, 1, True, True, False, False, y_nhwc, 32, 16, 16, 8, 19, 1, dtype=dtype).launch(
            x_cl, w_cl, bias, stored, poisoned(19, B * C_OUT * OH * OW), *sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_forward_reads_flipped_taps(dtype):
    """FLIP_TAPS: w holds its taps in reverse order (a 3x2 kernel, so each axis counts), and y is the
    convolution with the weight as it was before the flip (how a stride-1 dx runs as a forward)."""
    B, C_IN, C_OUT, H, W, stride, pad, dil = 2, 16, 24, 6, 7, (1, 1), (2, 1), (1, 2)
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, 3, 2, stride, pad, dil)
    x, w, bias = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, 3, 2, dtype=dtype), randn(C_OUT, dtype=dtype)
    x_cl, w_flipped = x.permute(0, 2, 3, 1).contiguous(), w.flip(2, 3).permute(0, 2, 3, 1).contiguous()
    y = poisoned(B, C_OUT, OH, OW, dtype=dtype)
    flipped = Conv2dGemmClForward(3, 2, *stride, *pad, *dil, 1, True, True, False, True, False, 32, 16, 16, 8, 1, 1,
                                  dtype=dtype)
    flipped.launch(x_cl, w_flipped, bias, y, torch.empty(0, device=x.device), B, C_IN, C_OUT, H, W, OH, OW)
    assert_close(y, _references(x, w, bias, randn(*y.shape), stride, pad, dil, 1)[0], dtype)


@pytest.mark.parametrize("tap_span", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_dw_tiles_spanning_taps(dtype, tap_span):
    """dw column tiles of several taps x all C_IN channels; the last tile's taps run past KH*KW
    (9 taps in tiles of 2 or 4), and C_OUT is ragged in its tile."""
    B, C_IN, C_OUT, H, W, stride, pad, dil = 2, 16, 24, 6, 7, (1, 2), (1, 1), (2, 1)
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, 3, 3, stride, pad, dil)
    x, dy = randn(B, C_IN, H, W, dtype=dtype), randn(B, C_OUT, OH, OW, dtype=dtype)
    w = randn(C_OUT, C_IN, 3, 3, dtype=dtype)
    geometry, sizes, split = (3, 3, *stride, *pad, *dil), (B, C_IN, C_OUT, H, W, OH, OW), 2
    x_cl, dy_cl = (t.permute(0, 2, 3, 1).contiguous() for t in (x, dy))
    partial = poisoned(split, dw_partial_size(C_OUT, C_IN, 3, 3, True), dtype=torch.float32)
    kernel = Conv2dGemmClDw(*geometry, 1, True, True, False, 16, 16 * tap_span, 16, tap_span, 1, dtype=dtype)
    kernel.launch(dy_cl, x_cl, partial, *sizes, split)
    dw, dbias = poisoned(C_OUT, C_IN, 3, 3, dtype=dtype), poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(True, 1, 1, 2, 64, dtype=dtype).launch(partial, dw, dbias, split, dw.numel(), C_OUT)
    _, _, dw64, db64 = _references(x, w, None, dy, stride, pad, dil, 1)
    assert_close(dw, dw64, dtype)
    assert_close(dbias, dy.double().sum((0, 2, 3)), dtype)
    with pytest.raises(ValueError, match=r"block_n: expected tap_span \* 16"):
        Conv2dGemmClDw(*geometry, 1, True, True, False, 16, 16, 16, 2, 1, dtype=dtype).launch(dy_cl, x_cl, partial,
                                                                                             *sizes, split)


# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation): C_OUT a multiple of BLOCK_K = 16, C_IN anything.
CL_DX_CASES = [
    pytest.param((2, 3, 16, 11, 10, 7, 7, (2, 2), (3, 3), (1, 1)), id="stem-7x7-s2-cin3"),
    pytest.param((2, 20, 32, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1)), id="3x3-s1"),
    pytest.param((1, 17, 16, 9, 8, 3, 2, (2, 3), (2, 0), (2, 1)), id="rect-stride23-dil2"),
    pytest.param((2, 5, 16, 5, 5, 1, 1, (2, 2), (0, 0), (1, 1)), id="1x1-s2"),
]


@pytest.mark.parametrize("dx_nhwc", [False, True], ids=["dx-nchw", "dx-nhwc"])
@pytest.mark.parametrize("block_q", [8, 32], ids=["4-images-per-tile", "1-image-per-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CL_DX_CASES)
def test_channels_last_dx_matches_float64(case, dtype, block_q, dx_nhwc):
    """dx from channels-last dy, every phase of every stride, dx written NCHW or NHWC; pixels and
    channels ragged in the tiles."""
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil = case
    OH, OW = _conv_sizes(B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil)
    x, w, dy = randn(B, C_IN, H, W, dtype=dtype), randn(C_OUT, C_IN, KH, KW, dtype=dtype), randn(B, C_OUT, OH, OW,
                                                                                                  dtype=dtype)
    dx = poisoned(*((B, H, W, C_IN) if dx_nhwc else (B, C_IN, H, W)), dtype=dtype)
    kernel = Conv2dGemmClDx(KH, KW, *stride, *pad, *dil, 1, True, False, dx_nhwc, 32, 16, 16, block_q, 1, dtype=dtype)
    w_t = w.permute(2, 3, 1, 0).contiguous()
    kernel.launch(dy.permute(0, 2, 3, 1).contiguous(), w_t, dx, B, C_IN, C_OUT, H, W, OH, OW)
    dx = dx.permute(0, 3, 1, 2) if dx_nhwc else dx
    assert_close(dx, _references(x, w, None, dy, stride, pad, dil, 1)[1], dtype)


@gpu
@pytest.mark.parametrize("case", CASES)
def test_gemm_kernels_tf32(case):
    ours, refs = _run_all(case, torch.float32, tf32=True)
    for out, ref in zip(ours, refs):
        if ref is not None:
            assert_close(out, ref, tol=TF32_TOLERANCE)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_kernels_large_blocks_gpu(dtype):
    """The GPU's tile shapes (128 pixels x 64 channels, split dw) on a ResNet-like layer."""
    case = (4, 64, 96, 15, 13, 3, 3, (1, 1), (1, 1), (1, 1), 1, True)
    ours, refs = _run_all(case, dtype, tf32=True, blocks=(128, 64, 32), split=5)
    for out, ref in zip(ours, refs):
        assert_close(out, ref, tol=max(TOLERANCE[dtype], TF32_TOLERANCE))


@gpu
def test_dx_and_dw_bitwise_deterministic():
    case = (4, 32, 48, 14, 14, 3, 3, (1, 1), (1, 1), (1, 1), 1, True)
    torch.manual_seed(3)
    first, _ = _run_all(case, torch.bfloat16, tf32=True, blocks=(64, 32, 32), split=7)
    torch.manual_seed(3)
    second, _ = _run_all(case, torch.bfloat16, tf32=True, blocks=(64, 32, 32), split=7)
    for a, b in zip(first[1:], second[1:]):
        assert torch.equal(a, b)


def test_launch_rejects_wrong_sizes_and_writes_nothing():
    kernel = Conv2dGemmForward(3, 3, 1, 1, 1, 1, 1, 1, 1, False, True, 16, 16, 16)
    x, w = randn(1, 2, 5, 5), randn(3, 2, 3, 3)
    y = poisoned(1, 3, 5, 5)
    with pytest.raises(ValueError, match="OH"):
        kernel.launch(x, w, y, y, 1, 2, 3, 5, 5, 4, 5)
    with pytest.raises(ValueError, match="w: expected"):
        kernel.launch(x, randn(3, 2, 3, 2), y, y, 1, 2, 3, 5, 5, 5, 5)
    assert torch.isnan(y).all()
    with pytest.raises(ValueError, match="C_IN"):
        Conv2dGemmDx(3, 3, 1, 1, 1, 1, 1, 1, 2, True, 16, 16, 16).launch(y, w, x, 1, 3, 4, 5, 5, 5, 5)
    with pytest.raises(ValueError, match="SPLIT"):
        Conv2dGemmDw(1, 1, 1, 1, 0, 0, 1, 1, 1, False, True, 16, 16, 16).launch(
            randn(1, 3, 2, 2), randn(1, 2, 2, 2), poisoned(5, 6, dtype=torch.float32), 1, 2, 3, 2, 2, 2, 2, 5
        )
    with pytest.raises(ValueError, match="partial"):
        Conv2dGemmDw(1, 1, 1, 1, 0, 0, 1, 1, 1, True, True, 16, 16, 16).launch(
            randn(1, 3, 2, 2), randn(1, 2, 2, 2), poisoned(2, 6, dtype=torch.float32), 1, 2, 3, 2, 2, 2, 2, 2
        )


def test_kernel_ids_name_every_constant():
    kernel = Conv2dGemmForward(3, 3, 1, 1, 1, 1, 1, 1, 1, True, False, 128, 64, 32, dtype=torch.bfloat16)
    assert kernel.id == "conv2d_gemm_forward__bf16__3__3__1__1__1__1__1__1__1__1__0__128__64__32"
    assert "Grid:" in type(kernel).__doc__
    with pytest.raises(ValueError, match="block_m"):
        Conv2dGemmForward(3, 3, 1, 1, 1, 1, 1, 1, 1, True, False, 96, 64, 32)


def test_device_is_the_suite_device():
    assert randn(1).device.type == DEVICE


def test_gpu_forward_candidates_tile_several_images_first_on_ragged_planes():
    """On a 132-SM GPU the channels-last forward first tries 64-pixel tiles of 16 (or 32) pixels of several
    images on planes over 256 pixels (as wide as the first guess, then 64 channels wide): on 28x28 planes
    they cover 784 = 49 x 16 pixels exactly, 392 programs where one image's 128-pixel tiles make 224. Not
    for dx (no taps), TMA-first planes, or a batch smaller than a tile's images."""
    found = channels_last_candidates(32, 784, 128, 128, torch.float32, GPU, taps=9)
    assert found[:2] == [GemmConfig(64, 128, 32, 4, 3, image_pixels=16),
                         GemmConfig(64, 64, 32, 4, 3, image_pixels=16)]  # full fp32's registers want 64
    assert pixel_tiles(found[0], 32, 784, 128) == 392
    assert pixel_tiles(GemmConfig(128, 128, 32), 32, 784, 128) == 224
    assert channels_last_candidates(32, 3136, 64, 64, torch.bfloat16, GPU, taps=9)[0].image_pixels == 32
    for batch, pixels, taps in ((32, 196, 9), (2, 784, 9), (32, 784, 0)):
        assert all(c.image_pixels == 0 for c in channels_last_candidates(batch, pixels, 128, 128, torch.float32, GPU,
                                                                         taps=taps))
