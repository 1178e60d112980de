"""The TMA-box data gradient (`Conv2dTmaDx`), launched directly, and its place among dx's algorithms.

References: torch's convolution backward in float64 on the same data; dx poisoned with NaN before launch.
Strides 2 and 3 over odd and even planes (phases of unequal sizes), paddings that put taps past dy's edges,
dilation, a 1x1 layer whose phases other than the first meet no tap, boxes that divide neither the phase planes
nor the batch, and channel tiles wider than the channels, so every edge of a box and of a tile is ragged.
"""
import pytest
import torch

from nnkernels.functional.conv_algorithms import dx_pass, forward_pass
from nnkernels.functional.conv_algorithms.tma import tma_dx_candidates
from nnkernels.functional.conv_problem import Problem
from nnkernels.ops.conv2d.tma_dx import Conv2dTmaDx
from support import CONV_TF32_TOLERANCE, DEVICE, DTYPES, GPU, assert_close, conv_output_sizes, dtype_id, poisoned, randn

# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation, box (BOX_B, BOX_H, BOX_W))
CASES = [
    pytest.param((3, 16, 32, 7, 9, 3, 3, (2, 2), (1, 1), (1, 1), (1, 4, 4)), id="3x3-stride2-odd-planes"),
    pytest.param((2, 24, 16, 8, 8, 3, 3, (2, 2), (1, 1), (1, 1), (2, 2, 4)), id="two-images-per-box"),
    pytest.param((2, 16, 16, 8, 7, 1, 1, (2, 2), (0, 0), (1, 1), (1, 4, 4)), id="1x1-stride2-empty-phases"),
    pytest.param((1, 16, 16, 11, 10, 5, 3, (3, 2), (2, 1), (1, 2), (1, 2, 8)), id="strides-3-2-dilated"),
    pytest.param((2, 32, 16, 6, 6, 7, 7, (2, 2), (3, 3), (1, 1), (1, 8, 2)), id="7x7-stride2-pad3"),
]


def _dx(case, dtype, tf32=True, blocks=(16, 16)):
    """(dx from Conv2dTmaDx as NCHW, torch's float64 dx)."""
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil, box = case
    OH, OW = conv_output_sizes((H, W), (KH, KW), stride, pad, dil)
    dy, w = randn(B, C_OUT, OH, OW, dtype=dtype), randn(C_OUT, C_IN, KH, KW, dtype=dtype)
    dx = poisoned(B, H, W, C_IN, dtype=dtype)
    kernel = Conv2dTmaDx(KH, KW, *stride, *pad, *dil, tf32, *box, *blocks, dtype=dtype)
    kernel.launch(dy.permute(0, 2, 3, 1).contiguous(), w.permute(2, 3, 1, 0).contiguous(), dx,
                  B, C_IN, C_OUT, H, W, OH, OW)
    ref = torch.nn.grad.conv2d_input((B, C_IN, H, W), w.double().cpu(), dy.double().cpu(), stride, pad, dil)
    return dx.permute(0, 3, 1, 2), ref


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_tma_dx_matches_float64(case, dtype):
    """fp32 runs tf32x3 (TF32 off) within fp32's tolerance."""
    dx, ref = _dx(case, dtype, tf32=False)
    assert_close(dx, ref, dtype)


def test_tma_dx_with_tf32_and_one_tile_of_channels():
    """TF32 on (on a GPU one TF32 product a slice; the interpreter multiplies in fp32) and channel tiles that
    hold all of C_IN and C_OUT."""
    dx, ref = _dx(CASES[0].values[0], torch.float32, tf32=True, blocks=(32, 32))
    assert_close(dx, ref, torch.float32, tol=CONV_TF32_TOLERANCE)


def _launch_args(C_IN=16, C_OUT=32, w_numel=None):
    """dy, w_t, dx and the sizes of a 3x3 stride-2 padding-1 layer on 8x8 planes."""
    dy = torch.zeros(2, 4, 4, C_OUT, device=DEVICE)
    w_t = torch.zeros(w_numel or 9 * C_IN * C_OUT, device=DEVICE)
    return [dy, w_t, poisoned(2, 8, 8, C_IN), 2, C_IN, C_OUT, 8, 8, 4, 4]


@pytest.mark.parametrize("constants, args, match", [
    ((3, 3, 2, 2, 1, 1, 1, 1, False, 1, 4, 3, 16, 16), {}, "box_w: expected a power of two"),
    ((3, 3, 2, 2, 1, 1, 1, 1, False, 1, 4, 4, 16, 32), {"C_OUT": 48}, "C_OUT: expected a multiple of block_k"),
    ((3, 3, 2, 2, 1, 1, 1, 1, False, 1, 4, 4, 16, 16), {"C_OUT": 6}, "C_OUT: expected a multiple of 4"),
    ((3, 3, 2, 2, 1, 1, 1, 1, False, 1, 4, 4, 16, 16), {"w_numel": 100}, "w_t: expected"),
    ((3, 3, 2, 2, 1, 1, 1, 1, False, 1, 4, 4, 16, 16), {"C_IN": 24}, "dx: expected"),
])
def test_tma_dx_launch_checks(constants, args, match):
    """Bad launches raise a ValueError naming the argument, and write nothing."""
    launch = _launch_args(**{k: v for k, v in args.items() if k != "C_IN"})
    if "C_IN" in args:
        launch[4] = args["C_IN"]
    with pytest.raises(ValueError, match=match):
        Conv2dTmaDx(*constants).launch(*launch)
    assert torch.isnan(launch[2]).all()


def test_a_strided_layer_offers_the_tma_dx_beside_the_pointer_kernel():
    """On a GPU with a TMA unit a strided channels-last layer in 16-channel runs lists the TMA dx's candidates
    and the pointer kernel's alternately, TMA first, so quick tuning times both; a stride-1 layer's dx is a
    forward and a layer not in 16s keeps the pointer kernel."""
    def dx_algorithms(c_in, stride):
        p = Problem((32, c_in, 28, 28), (64, c_in, 3, 3), (stride, stride), (1, 1), (1, 1), 1, torch.bfloat16, False,
                    GPU, nhwc=True)
        return [choice.algorithm for choice in dx_pass(p).candidates()]

    assert dx_algorithms(128, 2)[:4] == ["tma_dx", "cl_dx", "tma_dx", "cl_dx"]
    assert "tma_dx" not in dx_algorithms(128, 1) and "tma_dx" not in dx_algorithms(24, 2)
    configs = tma_dx_candidates(32, 4, (14, 14), 256, 128, torch.bfloat16, GPU)
    assert all(c.block_k == 64 and c.block_n == 128 for c in configs) and {c.block_m for c in configs} == {64, 128}


def test_128_pixel_tiles_go_first_where_they_fill_the_sms():
    """128-pixel tiles lead the TMA forward's and dx's lists where they still make a program per SM (ResNet-50's
    1x1 512->2048 @7 at batch 32: 13 x 16 programs on 132 SMs), and follow the 64-pixel ones where they would not
    (1x1 2048->512 @7: 13 x 4); on small planes the channels-last forward's first guess stays among the first
    three candidates either way, so quick tuning times it."""
    def first_three(c_in, c_out, size):
        p = Problem((32, c_in, size, size), (c_out, c_in, 1, 1), (1, 1), (0, 0), (1, 1), 1, torch.bfloat16, False, GPU,
                    nhwc=True)
        return [(c.algorithm, c.config.block_m) for c in forward_pass(p).candidates()[:3]]

    assert first_three(512, 2048, 7) == [("tma_forward", 128), ("tma_forward", 128), ("cl_forward", 128)]
    assert first_three(2048, 512, 7) == [("tma_forward", 64), ("tma_forward", 64), ("cl_forward", 128)]
    assert [c.block_m for c in tma_dx_candidates(32, 4, (7, 7), 512, 512, torch.bfloat16, GPU)] == [128, 64, 64]
    assert [c.block_m for c in tma_dx_candidates(2, 4, (7, 7), 512, 512, torch.bfloat16, GPU)] == [64, 64, 128]
