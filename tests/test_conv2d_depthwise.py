"""The direct depthwise kernels (forward, dx, dw split over its work items + ordered reduce), launched directly.

References: torch's grouped convolution (groups = C) in float64 on the same data; outputs
poisoned with NaN before launch; tiles that divide neither the planes' rows and columns nor B*C
(nor C, for dw), so every edge of a tile is ragged.
"""
import pytest
import torch

from nnkernels.ops.conv2d.depthwise import Conv2dDepthwiseDw, Conv2dDepthwiseDx, Conv2dDepthwiseForward
from nnkernels.ops.conv2d.partials import dw_partial_size
from support import (DTYPES, GPU, assert_close, conv_output_sizes, depthwise_conv2d_float64, gpu, poisoned, randn,
                     reduce_depthwise_dw)

# (B, C, H, W, KH, KW, stride, pad, dilation, bias)
CASES = [
    pytest.param((2, 3, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), True), id="3x3-pad1-bias"),
    pytest.param((2, 2, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), False), id="3x3-stride2"),
    pytest.param((2, 1, 10, 9, 3, 5, (2, 1), (2, 1), (2, 1), True), id="rect-dilated"),
]


def _run_all(case, dtype, tile=(4, 4, 4), split=2, gather=False):
    """(output, float64 reference, `assert_close` floor) for the forward, dx, dw and dbias of `case`,
    with `tile` = (PLANES, ROWS, BLOCK_W) for every kernel and GATHER_COLUMNS = `gather` for the forward and dw."""
    B, C, H, W, KH, KW, stride, pad, dil, has_bias = case
    OH, OW = conv_output_sizes((H, W), (KH, KW), stride, pad, dil)
    x, w, dy = randn(B, C, H, W, dtype=dtype), randn(C, 1, KH, KW, dtype=dtype), randn(B, C, OH, OW, dtype=dtype)
    bias = randn(C, dtype=dtype) if has_bias else None
    geometry = (KH, KW, *stride, *pad, *dil)
    sizes = (B, C, H, W, OH, OW)
    y = poisoned(B, C, OH, OW, dtype=dtype)
    forward = Conv2dDepthwiseForward(*geometry, has_bias, *tile, gather, dtype=dtype)
    forward.launch(x, w, bias if has_bias else y, y, *sizes)
    dx = poisoned(B, C, H, W, dtype=dtype)
    Conv2dDepthwiseDx(*geometry, *tile, dtype=dtype).launch(dy, w, dx, *sizes)
    partial = poisoned(split, dw_partial_size(C, 1, KH, KW, has_bias), dtype=torch.float32)
    taps = 1 << (KH * KW).bit_length()  # more than KH*KW: a column for the bias
    ragged = OH % tile[1] != 0  # both builds: with the ragged band's copy and without
    dw_kernel = Conv2dDepthwiseDw(*geometry, has_bias, taps, *tile, gather, ragged, dtype=dtype)
    dw_kernel.launch(dy, x, partial, *sizes, split)
    dw, dbias = reduce_depthwise_dw(partial, split, C, KH, KW, has_bias, dtype)
    y64, dx64, dw64, dbias64 = depthwise_conv2d_float64(x, w, bias, dy, stride, pad, dil)
    # One channel's bias gradient is a single sum of B*OH*OW random terms: measured against their magnitudes.
    dbias_floor = dy.double().abs().sum((0, 2, 3)).norm().item()
    pairs = [(y, y64, 0.0), (dx, dx64, 0.0), (dw, dw64, 0.0)]
    return pairs + ([(dbias, dbias64, dbias_floor)] if has_bias else [])


@pytest.mark.parametrize("case", CASES)
def test_depthwise_kernels_match_float64(case):
    for out, ref, floor in _run_all(case, torch.float32):
        assert_close(out, ref, torch.float32, floor=floor)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]])
def test_depthwise_gathered_columns_match_float64(case):
    """Rows loaded once and their taps shifted across lanes (unit column stride, 16-lane rows)."""
    for out, ref, floor in _run_all(case, torch.float32, tile=(4, 4, 16), gather=True):
        assert_close(out, ref, torch.float32, floor=floor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_depthwise_kernels_16bit(dtype):
    for out, ref, floor in _run_all(CASES[0].values[0], dtype):
        assert_close(out, ref, dtype, floor=floor)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_depthwise_kernels_gpu_tiles(dtype):
    case = (6, 40, 29, 31, 3, 3, (1, 1), (1, 1), (1, 1), True)
    for out, ref, floor in _run_all(case, dtype, tile=(2, 6, 16), split=4):
        assert_close(out, ref, dtype, floor=floor)
    thirty_columns = case[:3] + (30,) + case[4:]  # 30 + 2 shifted columns fill a 32-lane row
    for out, ref, floor in _run_all(thirty_columns, dtype, tile=(2, 6, 32), split=4, gather=True):
        assert_close(out, ref, dtype, floor=floor)


@gpu
def test_depthwise_backward_bitwise_deterministic():
    case = (8, 64, 28, 28, 3, 3, (1, 1), (1, 1), (1, 1), True)
    torch.manual_seed(5)
    first = _run_all(case, torch.float32, tile=(2, 5, 32), split=8, gather=True)
    torch.manual_seed(5)
    second = _run_all(case, torch.float32, tile=(2, 5, 32), split=8, gather=True)
    for (a, _, _), (b, _, _) in zip(first[1:], second[1:]):
        assert torch.equal(a, b)


def test_depthwise_launch_checks():
    dw_kernel = Conv2dDepthwiseDw(3, 3, 1, 1, 1, 1, 1, 1, False, 8, 1, 4, 4, False, True)
    dy, x = randn(2, 3, 4, 4), randn(2, 3, 4, 4)
    partial = poisoned(1, 27, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_taps"):
        dw_kernel.launch(dy, x, partial, 2, 3, 4, 4, 4, 4, 1)
    good = Conv2dDepthwiseDw(3, 3, 1, 1, 1, 1, 1, 1, False, 16, 1, 4, 4, False, True)
    with pytest.raises(ValueError, match="SPLIT"):
        good.launch(dy, x, poisoned(3, 27, dtype=torch.float32), 2, 3, 4, 4, 4, 4, 3)
    whole_bands = Conv2dDepthwiseDw(3, 3, 1, 1, 1, 1, 1, 1, False, 16, 1, 3, 4, False, False)
    with pytest.raises(ValueError, match="RAGGED_BANDS: expected True where OH = 4 is not a multiple of ROWS = 3"):
        whole_bands.launch(dy, x, partial, 2, 3, 4, 4, 4, 4, 1)
    assert torch.isnan(partial).all()  # nothing written
    with pytest.raises(ValueError, match="rows: expected a multiple of stride_h = 2"):
        Conv2dDepthwiseDx(3, 3, 2, 2, 1, 1, 1, 1, 1, 3, 4).launch(randn(2, 3, 2, 2), randn(3, 1, 3, 3), x,
                                                              2, 3, 4, 4, 2, 2)
    with pytest.raises(ValueError, match="OW"):
        Conv2dDepthwiseForward(3, 3, 1, 1, 1, 1, 1, 1, False, 1, 4, 4, False).launch(
            x, randn(3, 1, 3, 3), x, x, 2, 3, 4, 4, 4, 3)
    with pytest.raises(ValueError, match="gather_columns: needs stride_w = 1 and 4 columns"):
        Conv2dDepthwiseForward(3, 3, 1, 1, 1, 1, 1, 1, False, 1, 4, 4, True).launch(
            x, randn(3, 1, 3, 3), x, x, 2, 3, 4, 4, 4, 4)
    assert torch.isnan(partial).all()


@pytest.mark.parametrize("planes, rows, cols, row_step, channels", [
    (8192, 28, 28, 1, None), (8192, 56, 56, 2, None), (240, 15, 15, 1, None), (240, 29, 29, 2, None),
    (30720, 7, 7, 1, None), (8192, 28, 28, 1, 256), (96, 112, 112, 1, 3), (5, 1, 300, 1, None),
])
def test_depthwise_gpu_tile_heuristic(planes, rows, cols, row_step, channels):
    """The GPU's tiles: dx bands a multiple of the stride, at most DEPTHWISE_BAND rows and as even as
    the plane allows, no more planes per program than dw's channels, and at least two programs per SM
    where halving the bands can give them."""
    from nnkernels.functional.conv_algorithms import depthwise
    from nnkernels.functional.conv_algorithms.base import pow2_at_least

    tile = depthwise.depthwise_tile(GPU, planes, rows, cols, row_step, channels)
    assert tile.rows % row_step == 0 and 0 < tile.rows <= max(depthwise.BAND, row_step)
    bands = -(-rows // tile.rows)
    assert bands * tile.rows - rows < bands * row_step  # the last band is short by less than one step per band
    assert tile.planes <= pow2_at_least(channels or planes) and tile.block_w >= min(cols, 64)
    assert tile.planes * tile.block_w <= depthwise.LANES
    programs = -(-planes // tile.planes) * bands * -(-cols // tile.block_w)
    assert programs >= 2 * 132 or tile.rows <= 2 * row_step or bands == rows


def test_depthwise_dw_whole_bands_build_matches_the_ragged_build():
    """Where the bands tile OH exactly, the build without the ragged band's copy gives bitwise its partials."""
    B, C, H, W, OH, OW, split = 2, 3, 8, 6, 8, 6, 2
    dy, x = randn(B, C, OH, OW), randn(B, C, H, W)
    partials = []
    for ragged in (True, False):
        partial = poisoned(split, dw_partial_size(C, 1, 3, 3, True), dtype=torch.float32)
        Conv2dDepthwiseDw(3, 3, 1, 1, 1, 1, 1, 1, True, 16, 4, 4, 4, False, ragged).launch(dy, x, partial, B, C, H, W,
                                                                                           OH, OW, split)
        partials.append(partial)
    assert not torch.isnan(partials[1]).any()
    assert torch.equal(partials[0], partials[1])
