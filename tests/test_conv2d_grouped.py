"""Grouped convolutions (groups > 1, not depthwise) on the channels-last kernels' block-diagonal tiles: forward, dx
and dw within each dtype's tolerance of float64, every output element written, in NCHW and channels-last, for
group widths that are powers of two and that are not, and every candidate config a GPU would time.

References: torch.nn.functional.conv2d and its autograd in float64 on the same data.
"""
import pytest
import torch

from nnkernels.functional.conv import conv2d, kernels_for
from nnkernels.ops.conv2d.channels_last import Conv2dGemmClDw, Conv2dGemmClForward, whole_windows
from nnkernels.ops.conv2d.grouped_weight import Conv2dGroupedWeight
from support import DTYPES, assert_conv2d_matches_float64, dtype_id, force_choice, randn

CL = torch.channels_last

# (B, C_IN, C_OUT, H, W, kernel, stride, padding, dilation, groups, bias)
CASES = [
    pytest.param((2, 16, 16, 7, 7, 3, 1, 1, 1, 4, True), id="4-per-group"),
    pytest.param((2, 32, 32, 6, 6, 3, 2, 1, 1, 4, False), id="8-per-group-stride2"),
    pytest.param((1, 48, 48, 5, 5, 3, 1, 1, 1, 2, True), id="24-per-group"),
    pytest.param((2, 24, 24, 6, 5, 3, 2, 1, 1, 3, True), id="8-per-group-3-groups-stride2"),
    pytest.param((2, 12, 24, 6, 6, 3, 1, 2, 2, 4, False), id="3-in-6-out-dilated"),
    pytest.param((2, 64, 32, 5, 4, 1, 1, 0, 1, 8, True), id="1x1-grouped"),
    pytest.param((2, 8, 16, 6, 6, 3, 2, 1, 1, 8, True), id="depthwise-multiplier-2-stride2"),
]


def _run(case, dtype, memory_format):
    B, C_IN, C_OUT, H, W, k, stride, padding, dilation, groups, has_bias = case
    x = randn(B, C_IN, H, W, dtype=dtype).contiguous(memory_format=memory_format).requires_grad_()
    w = (randn(C_OUT, C_IN // groups, k, k, dtype=dtype) / (C_IN // groups * k * k) ** 0.5).requires_grad_()
    b = randn(C_OUT, dtype=dtype).requires_grad_() if has_bias else None
    options = (stride, padding, dilation, groups)
    y = conv2d(x, w, b, *options)
    dy = randn(*y.shape, dtype=dtype).contiguous(memory_format=memory_format)
    leaves = (x, w) + ((b,) if b is not None else ())
    grads = torch.autograd.grad(y, leaves, dy)
    assert y.is_contiguous(memory_format=memory_format) and grads[0].is_contiguous(memory_format=memory_format)
    assert_conv2d_matches_float64(y, grads, leaves, dy, options, dtype)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_grouped_conv2d_matches_float64(case, dtype, memory_format, poisoned_outputs):
    with torch.backends.cudnn.flags(allow_tf32=False):
        _run(case, dtype, memory_format)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4]])
def test_every_gpu_candidate_is_correct(case, gpu_lists, monkeypatch, poisoned_outputs):
    """Each candidate a GPU would time for the grouped passes (forced one index at a time, until every list is
    spent), in bf16 and channels-last: the tiles that lie inside a group and those spanning several."""
    index, offered = 0, {}
    while True:
        force_choice(monkeypatch, index, offered)
        _run(case, torch.bfloat16, CL)
        index += 1
        if all(len(listed) <= index for listed in offered.values()):
            break
    assert max(len(listed) for listed in offered.values()) > 1


def test_grouped_layers_run_on_the_channels_last_kernels():
    """A grouped layer's passes are the channels-last forward (dx too, at stride 1, as the transposed forward, and
    the dx kernel when strided) and dw, the forward and dx on block-diagonal weights written per call; a
    channels-last layer makes no layout copy."""
    ids = kernels_for((2, 32, 8, 8), (32, 8, 3, 3), 1, 1, groups=4, dtype=torch.bfloat16, channels_last=True)
    names = [k.split("__")[0] for k in ids]
    assert names == ["conv2d_grouped_weight", "conv2d_gemm_cl_forward", "conv2d_grouped_weight",
                     "conv2d_gemm_cl_forward", "conv2d_gemm_cl_dw", "conv2d_dw_reduce"], names
    strided = kernels_for((2, 32, 8, 8), (32, 8, 3, 3), 2, 1, groups=4, dtype=torch.bfloat16, channels_last=True)
    assert [k.split("__")[0] for k in strided][2:4] == ["conv2d_grouped_weight", "conv2d_gemm_cl_dx"], strided
    depthwise = kernels_for((2, 32, 8, 8), (32, 1, 3, 3), 1, 1, groups=32, dtype=torch.bfloat16)
    assert all("conv2d_gemm_cl" not in k for k in depthwise)


@pytest.mark.parametrize("sizes, whole", [
    ((128, 4, 4, 16, 32, 16), True),  # ResNeXt's first stage: 4 groups a tile
    ((1024, 32, 32, 16, 32, 16), True),  # a tile inside one group
    ((128, 4, 4, 64, 32, 64), True),  # 16 groups a tile, 2 tiles
    ((48, 24, 24, 32, 2, 32), False),  # tiles straddle groups
    ((24, 8, 8, 16, 3, 16), False),  # 2 groups a tile, 3 groups: the last tile's window is cut short
    ((12, 4, 4, 16, 3, 16), False),  # a window of 12 channels, slices of 16
    ((64, 64, 64, 16, 1, 16), True),  # one group: its one window, whole slices
    ((72, 72, 72, 16, 1, 64), False),  # one group: the last slice of a tap masked
])
def test_whole_windows(sizes, whole):
    """(c_in, in per group, out per group, tile, groups, slice) -> whether every tile's window is whole, aligned and
    a whole number of slices."""
    assert whole_windows(*sizes) is whole


def test_grouped_cases_cover_whole_and_masked_windows():
    """The float64 cases run the grouped forward both with WHOLE_WINDOWS (unmasked vector loads) and without."""
    flags = set()
    for case in CASES:
        B, C_IN, C_OUT, H, W, k, stride, padding, dilation, groups, _ = case.values[0]
        ids = kernels_for((B, C_IN, H, W), (C_OUT, C_IN // groups, k, k), stride, padding, dilation, groups,
                          dtype=torch.bfloat16, channels_last=True)
        forward = next(i for i in ids if i.startswith("conv2d_gemm_cl_forward"))
        flags.add(forward.split("__")[2 + 9])  # the constant after the 8 of the geometry and G
    assert flags == {"0", "1"}, flags


def test_grouped_launch_checks():
    """A grouped forward cannot split K, nor skip the channel mask where windows are not whole; a dw tile spanning
    taps must hold the whole window of its groups."""
    x, w, y = randn(1, 5, 5, 16), randn(16 * 9 * 16), randn(1, 16, 5, 5)  # w: 16-wide rows of 4 groups
    straddling = Conv2dGemmClForward(3, 3, 1, 1, 1, 1, 1, 1, 2, True, False, False, False, False, 32, 16, 16, 32, 1, 1,
                                     dtype=torch.float32)
    x24, w24, y24 = randn(1, 5, 5, 48), randn(48 * 9 * 48), randn(1, 48, 5, 5)  # 24 per group: 48-wide rows
    with pytest.raises(ValueError, match="whole_windows: expected False"):
        straddling.launch(x24, w24, y24, y24, torch.empty(0, device=x.device), 1, 48, 48, 5, 5, 5, 5)
    split = Conv2dGemmClForward(3, 3, 1, 1, 1, 1, 1, 1, 4, False, False, False, False, False, 32, 16, 16, 32, 2, 1,
                                dtype=torch.float32)
    with pytest.raises(ValueError, match="split_k: expected 1 for a grouped convolution"):
        split.launch(x, w, y, y, torch.empty(0, device=x.device), 1, 16, 16, 5, 5, 5, 5)
    dw = Conv2dGemmClDw(3, 3, 1, 1, 1, 1, 1, 1, 4, False, False, False, 16, 32, 16, 4, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_n: expected tap_span"):
        dw.launch(randn(1, 5, 5, 16), x, torch.empty(16 * 4 * 9, device=x.device), 1, 16, 16, 5, 5, 5, 5, 1)
    expand = Conv2dGroupedWeight(False, False, 64, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="out: expected ROWS\\*TAPS\\*WIDTH"):
        expand.launch(randn(16, 4, 3, 3), torch.empty(16, device=x.device), 16, 9, 4, 4, 16, 16)
