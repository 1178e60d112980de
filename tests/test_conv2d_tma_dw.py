"""The TMA-box weight gradient (`Conv2dTmaDw`) and the tap-major reduce, launched directly.

References: torch's convolution backward in float64 on the same data; partials and outputs
poisoned with NaN before launch; boxes that divide neither the output's rows nor its columns,
channel tiles wider than the channels, so every edge of a box and of a tile is ragged.
"""
import pytest
import torch

from nnkernels.functional.conv_algorithms.channels_last import channels_last_candidates
from nnkernels.functional.conv_algorithms.partials import REDUCE_TILE, reduce_tile
from nnkernels.functional.conv_algorithms.tma import tma_box, tma_dw_candidates
from nnkernels.ops.conv2d.partials import Conv2dDwReduce, dw_partial_size
from nnkernels.ops.conv2d.tma_dw import Conv2dTmaDw
from support import BF16X3_TOLERANCE, DEVICE, DTYPES, GPU, assert_close, dtype_id, poisoned, randn

# (B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dilation, bias)
CASES = [
    pytest.param((2, 16, 24, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), True), id="3x3-pad1-bias"),
    pytest.param((1, 16, 16, 9, 5, 3, 2, (1, 1), (2, 0), (2, 1), False), id="rect-dilated-unpadded-columns"),
    pytest.param((3, 32, 16, 5, 11, 1, 1, (1, 1), (0, 0), (1, 1), True), id="1x1"),
    # Kernel rows 0 and 2 meet only padding (2 input rows, padding 2, dilation 2): empty tap windows.
    pytest.param((2, 16, 16, 2, 3, 3, 3, (1, 1), (2, 2), (2, 2), False), id="taps-on-padding-only"),
    # Odd planes: the last row and column of x belong to some taps' windows only.
    pytest.param((2, 16, 24, 7, 9, 3, 3, (2, 2), (1, 1), (1, 1), True), id="3x3-stride2-odd-planes"),
    pytest.param((2, 32, 16, 8, 7, 1, 1, (2, 2), (0, 0), (1, 1), False), id="1x1-stride2"),
    pytest.param((1, 16, 16, 11, 10, 3, 3, (2, 3), (1, 2), (2, 1), True), id="strides-2-3-dilated"),
]


def _tma_dw(case, dtype, row_taps, split, box=(4, 4), blocks=(16, 16), tf32=False):
    """(dw, dbias) from Conv2dTmaDw + the tap-major reduce, and torch's float64 (dw, dbias)."""
    B, C_IN, C_OUT, H, W, KH, KW, stride, pad, dil, has_bias = case
    OH, OW = ((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in
              zip((H, W), (KH, KW), stride, pad, dil))
    x, dy = randn(B, C_IN, H, W, dtype=dtype), randn(B, C_OUT, OH, OW, dtype=dtype)
    partial = poisoned(split, dw_partial_size(C_OUT, C_IN, KH, KW, has_bias))
    kernel = Conv2dTmaDw(KH, KW, *stride, *pad, *dil, has_bias, tf32, row_taps, *blocks, *box, dtype=dtype)
    kernel.launch(dy.permute(0, 2, 3, 1).contiguous(), x.permute(0, 2, 3, 1).contiguous(), partial,
                  B, C_IN, C_OUT, H, W, OH, OW, split)
    dw, dbias = poisoned(C_OUT, C_IN, KH, KW, dtype=dtype), poisoned(C_OUT, dtype=dtype)
    Conv2dDwReduce(has_bias, KH * KW, 16, 2, 64, dtype=dtype).launch(partial, dw, dbias if has_bias else dw,
                                                                      split, dw.numel(), C_OUT)
    x64 = x.double().cpu().requires_grad_()
    w64 = torch.zeros(C_OUT, C_IN, KH, KW, dtype=torch.float64, requires_grad=True)
    b64 = torch.zeros(C_OUT, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.conv2d(x64, w64, b64, stride, pad, dil).backward(dy.double().cpu())
    return (dw, dbias if has_bias else None), (w64.grad, b64.grad if has_bias else None)


@pytest.mark.parametrize("dtype, tf32", [(torch.float32, False), (torch.float32, True), *(
    (dtype, True) for dtype in DTYPES[1:])], ids=["fp32", "fp32-tf32-allowed", *map(dtype_id, DTYPES[1:])])
@pytest.mark.parametrize("row_taps", ["one-tap", "kernel-row"])
@pytest.mark.parametrize("case", CASES)
def test_tma_dw_matches_float64(case, row_taps, dtype, tf32):
    """fp32 with TF32 allowed runs three bf16 products of split values, within BF16X3_TOLERANCE."""
    taps = 1 if row_taps == "one-tap" else case[6]
    ours, refs = _tma_dw(case, dtype, taps, split=2, tf32=tf32)
    for out, ref in zip(ours, refs):
        if ref is not None:
            assert_close(out, ref, dtype, tol=BF16X3_TOLERANCE if dtype == torch.float32 and tf32 else None)


@pytest.mark.parametrize("split", [1, 6], ids=["one-slice", "six-slices"])
@pytest.mark.parametrize("box", [(2, 8), (8, 2)], ids=["wide-boxes", "tall-boxes"])
def test_tma_dw_boxes_and_splits(box, split):
    """Boxes of other shapes over the 2 images' 7x6 outputs (8 boxes of 2x8, 6 of 8x2), in one
    slice or in six of one or two boxes each."""
    case = CASES[0].values[0]
    ours, refs = _tma_dw(case, torch.float32, 3, split, box=box, blocks=(32, 16))
    for out, ref in zip(ours, refs):
        assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block", [4, 16], ids=["ragged-programs", "one-program"])
def test_tap_major_reduce_puts_partials_in_dw_order(block):
    """partial[s, tap*C_OUT*C_IN + c_out*C_IN + c_in] summed over s lands at dw[c_out, c_in, tap], and
    the bias sums after them at dbias[c_out], from programs of `block` positions (15 in all)."""
    C_OUT, C_IN, taps, split = 3, 5, 6, 5
    partial = randn(split, taps * C_OUT * C_IN + C_OUT)
    dw, dbias = poisoned(C_OUT, C_IN, 2, 3), poisoned(C_OUT)
    Conv2dDwReduce(True, taps, 8, 4, block).launch(partial, dw, dbias, split, dw.numel(), C_OUT)
    sums = partial.double().sum(0)
    expected = sums[:dw.numel()].reshape(taps, C_OUT, C_IN).permute(1, 2, 0).reshape(C_OUT, C_IN, 2, 3)
    assert_close(dw, expected, torch.float32)
    assert_close(dbias, sums[dw.numel():], torch.float32)


@pytest.mark.parametrize("constants, sizes, match", [
    ((False, 6, 4, 4, 16), (90, 3), "tap_block: expected at least taps = 6, got 4"),
    ((False, 6, 12, 4, 16), (90, 3), "tap_block: expected a power of two, got 12"),
    ((False, 6, 8, 4, 16), (91, 3), "N_DW: expected a multiple of taps = 6, got 91"),
    ((True, 6, 8, 4, 16), (12, 3), "C_OUT: expected at most N_DW / taps = 2"),
])
def test_reduce_refuses_bad_tiles_and_writes_nothing(constants, sizes, match):
    n_dw, c_out = sizes
    partial, dw, dbias = randn(2, n_dw + c_out), poisoned(n_dw), poisoned(c_out)
    with pytest.raises(ValueError, match=match):
        Conv2dDwReduce(*constants).launch(partial, dw, dbias, 2, n_dw, c_out)
    assert torch.isnan(dw).all() and torch.isnan(dbias).all()


def _launch_args(C, split, B=1, H=4, W=4):
    """dy, x (both 4x4, so one 4x4 box), partial, sizes, SPLIT."""
    x, dy = torch.zeros(B, H, W, C, device=DEVICE), torch.zeros(B, H, W, C, device=DEVICE)
    partial = poisoned(split, dw_partial_size(C, C, 3, 3, False))
    return [dy, x, partial, B, C, C, H, W, H, W, split]


@pytest.mark.parametrize("constants, args, match", [
    ((3, 3, 1, 1, 1, 1, 1, 1, False, False, 2, 16, 16, 4, 4), {}, "row_taps: expected a divisor of KW"),
    ((3, 3, 1, 1, 1, 1, 1, 1, False, False, 1, 16, 16, 4, 4), {"C": 6}, "C_IN: expected a multiple of 4"),
    ((3, 3, 1, 1, 1, 1, 1, 1, False, False, 1, 16, 16, 4, 4), {"split": 2}, r"SPLIT: expected at most .* = 1 slices"),
    ((3, 3, 1, 1, 1, 1, 1, 1, False, False, 1, 16, 16, 4, 3), {}, "box_w: expected a power of two"),
    ((3, 3, 1, 1, 1, 1, 1, 1, False, False, 1, 16, 16, 0, 4), {}, "box_h: expected an int >= 1, got 0"),
])
def test_tma_dw_launch_checks(constants, args, match):
    """Bad launches raise a ValueError naming the argument, and write nothing."""
    launch = _launch_args(args.get("C", 16), args.get("split", 1))
    with pytest.raises(ValueError, match=match):
        Conv2dTmaDw(*constants).launch(*launch)
    assert torch.isnan(launch[2]).all()


@pytest.mark.parametrize("plane, pixels, box", [((56, 56), 64, (8, 8)), ((28, 28), 64, (2, 32)),
                                                ((14, 14), 64, (4, 16)), ((7, 7), 64, (8, 8)), ((7, 7), 32, (4, 8)),
                                                ((1, 100), 64, (1, 64))])
def test_tma_box_wastes_least(plane, pixels, box):
    """The box covers the plane with the fewest wasted pixels, the widest among equals."""
    rows, cols = plane
    assert tma_box(rows, cols, pixels) == box

    def covered(b):
        return -(-rows // b[0]) * b[0] * -(-cols // b[1]) * b[1]

    others = [(pixels // (1 << i), 1 << i) for i in range(pixels.bit_length()) if 1 << i <= pixels]
    assert all(covered(box) <= covered(other) for other in others)


@pytest.mark.parametrize("layer", [(32, 64, 56), (32, 256, 14), (32, 512, 7), (2, 48, 13)],
                         ids=lambda layer: "x".join(map(str, layer)))
def test_gpu_candidates_fill_the_sms_once(layer):
    """On a 132-SM GPU: the TMA dw's splits never start more programs than their per-SM target
    allows (a second, nearly empty wave doubled the time), and the forward's split-K variants follow
    their own tile set, only where it has fewer programs than SMs, in 2 to 4 slices of at least four
    K-steps."""
    batch, channels, size = layer
    for dtype in (torch.bfloat16, torch.float32):
        for config in tma_dw_candidates(channels, channels, 3, 3, batch, size, size, dtype, GPU):
            tiles = -(-channels // config.block_m) * -(-channels // config.block_n) * 9 // config.taps
            assert tiles * config.split <= 6 * 132 or config.split == 1
            assert config.taps in (1, 3) and config.block_k == (32 if dtype == torch.float32 else 64)
        found = channels_last_candidates(batch, size * size, channels, channels, dtype, GPU, taps=9)
        for before, config in zip(found, found[1:]):
            if config.split > 1:
                assert (before.block_m, before.block_n, before.split) == (config.block_m, config.block_n, 1)
                assert 2 <= config.split <= 4 and 9 * channels // config.block_k >= 4 * config.split
        assert found[0].split == 1
        assert all(c.split == 1 for c in channels_last_candidates(batch, size * size, channels, channels, dtype, GPU))
    if size <= 14 and channels >= 256:  # 52 to 98 tiles of 128 x 128 for 132 SMs: split K is offered
        assert any(c.split > 1 for c in found)


@pytest.mark.parametrize("positions, taps", [(512 * 512, 9), (64 * 64, 9), (64 * 256, 1), (2 * 10**6, 1), (100, 25)])
def test_gpu_reduce_tiles_keep_128_positions_and_bound_the_load(positions, taps):
    """On a 132-SM GPU the reduce's programs take all taps of at least 128 positions (narrower tiles
    measured 4x slower on the H200), load at most REDUCE_TILE values at once (for up to 64 taps;
    one split row of TAP_BLOCK x 128 beyond), and more split rows at once when a program is narrower."""
    tap_block, split_rows, block = reduce_tile(positions, taps, GPU)
    assert tap_block >= taps and not tap_block & (tap_block - 1) and not split_rows & (split_rows - 1)
    assert 128 <= block <= max(128, 1024 // tap_block)
    assert split_rows * tap_block * block <= REDUCE_TILE
    assert split_rows == min(64, REDUCE_TILE // (tap_block * block))
