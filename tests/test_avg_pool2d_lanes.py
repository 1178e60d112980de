"""The lanes avg-pool kernels (vector row loads, lanes split in registers) against
torch.nn.functional.avg_pool2d in float64, and the launcher's choice between them and the gather kernels."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nnkernels.functional import avg_pool2d, last_kernels
from nnkernels.functional.pooling_algorithms import LANES_PROGRAMS
from nnkernels.ops.avg_pool2d.gather import row_align, uniform_divisor
from nnkernels.ops.avg_pool2d.lanes import AvgPool2dLanesBackward, AvgPool2dLanesForward, backward_lanes, forward_lanes
from support import assert_close, force_choice, poisoned, randn


# (B, C, H, W, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, backward path):
# the backward path is "vec" (dy rows vector-loaded), "scalar" (dy rows of a length SRC does not
# divide) or None (a divisor that varies per window: the gather kernel's case).
CASES = [
    (2, 3, 8, 8, (3, 3), (1, 1), (1, 1), False, True, None, "vec"),  # k3 s1 p1: both neighbour groups
    (2, 3, 7, 12, (3, 3), (1, 1), (1, 1), False, False, None, None),  # padding left out of the divisor
    (2, 3, 9, 12, (3, 3), (2, 2), (0, 0), False, True, None, "scalar"),  # k3 s2: odd OW, right neighbour only
    (2, 3, 9, 12, (3, 3), (2, 2), (1, 1), True, False, None, None),  # ceil_mode overhang, padding not counted
    (2, 3, 8, 8, (2, 2), (2, 2), (0, 0), False, True, None, "vec"),  # k2 s2: no neighbours
    (1, 2, 6, 8, (3, 3), (2, 2), (1, 1), False, True, 5, "vec"),  # divisor_override
    (1, 2, 7, 8, (2, 2), (1, 1), (1, 1), True, True, None, "scalar"),  # k2 s1 p1 ceil: OW = W + 1
    (1, 2, 7, 16, (4, 4), (1, 1), (2, 2), False, True, None, "scalar"),  # k4 p2: two-column reach each side
    (1, 2, 7, 16, (5, 3), (2, 2), (2, 1), True, False, None, None),  # rectangular, overhang, not counted
]


def _options(kernel, stride, padding, cip, divisor):
    return SimpleNamespace(kh=kernel[0], kw=kernel[1], stride_h=stride[0], stride_w=stride[1], pad_h=padding[0],
                           pad_w=padding[1], count_include_pad=cip, divisor_override=divisor or 0)


def _run(case, dtype, block_r, block_g):
    B, C, H, W, kernel, stride, padding, ceil_mode, cip, divisor, backward_path = case
    x = randn(B, C, H, W, dtype=dtype)
    x64 = x.to(torch.float64).requires_grad_()
    ref = F.avg_pool2d(x64, kernel, stride, padding, ceil_mode, cip, divisor)
    OH, OW = ref.shape[2:]
    options = _options(kernel, stride, padding, cip, divisor)
    uniform = uniform_divisor(options, H, W, OH, OW)
    common = (*kernel, *stride, *padding, cip, divisor or 0, uniform)
    lanes = forward_lanes(options, W, x.element_size())
    assert lanes > 0, "every case has a lanes forward"
    y = poisoned(B, C, OH, OW, dtype=dtype)
    AvgPool2dLanesForward(*common, lanes, min(row_align(OW), lanes), block_r, block_g, dtype=dtype).launch(
        x, y, B * C, H, W, OH, OW)
    assert_close(y, ref, dtype)

    lanes, src_vec = backward_lanes(options, W, OW, x.element_size(), uniform)
    assert {None: 0, "vec": lanes, "scalar": lanes}[backward_path] == lanes
    assert src_vec == (backward_path == "vec")
    if lanes:
        dy = randn(B, C, OH, OW, dtype=dtype)
        ref.backward(dy.to(torch.float64))
        dx = poisoned(B, C, H, W, dtype=dtype)
        AvgPool2dLanesBackward(*common, lanes, src_vec, min(row_align(W), lanes), block_r, block_g,
                               dtype=dtype).launch(dy, dx, B * C, H, W, OH, OW)
        assert_close(dx, x64.grad, dtype)


CASES_BY_DTYPE = [(case, torch.float32) for case in CASES] + [
    (case, dtype) for dtype in (torch.float16, torch.bfloat16) for case in (CASES[0], CASES[2], CASES[3])]


@pytest.mark.parametrize("case, dtype", CASES_BY_DTYPE,
                         ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else "-".join(
                             map(str, v[4:10])))
def test_lanes_kernels_match_pytorch(case, dtype):
    """One program per launch (blocks cover the small problem)."""
    _run(case, dtype, 64, 8)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[7]], ids=["k3s1p1", "k3s2", "k4p2"])
def test_tiles_split_rows_and_groups(case):
    """One group and 4 rows per tile: neighbour groups come from other tiles, row tiles end mid-plane."""
    _run(case, torch.float32, 4, 1)


def test_bad_launch_raises_and_writes_nothing():
    x = randn(1, 2, 8, 8)
    y = poisoned(1, 2, 8, 8)
    args = (x, y, 2, 8, 8, 8, 8)
    AvgPool2dLanesForward(3, 3, 1, 1, 1, 1, True, 0, True, 4, 4, 16, 2).launch(*args)  # the valid launch
    y.fill_(float("nan"))
    with pytest.raises(ValueError, match="lanes"):  # 16 source lanes: wider than the kernel splits
        AvgPool2dLanesForward(3, 3, 1, 1, 1, 1, True, 0, True, 16, 8, 16, 1).launch(*args)
    with pytest.raises(ValueError, match="row_align"):
        AvgPool2dLanesForward(3, 3, 1, 1, 1, 1, True, 0, True, 4, 2, 16, 2).launch(*args)
    with pytest.raises(ValueError, match="uniform"):
        AvgPool2dLanesForward(3, 3, 1, 1, 1, 1, True, 0, False, 4, 4, 16, 2).launch(*args)
    with pytest.raises(ValueError, match="OW"):
        AvgPool2dLanesForward(3, 3, 1, 1, 1, 1, True, 0, True, 4, 4, 16, 2).launch(x, y, 2, 8, 8, 8, 7)
    dx = poisoned(1, 2, 8, 8)
    with pytest.raises(ValueError, match="src_vec"):
        AvgPool2dLanesBackward(3, 3, 1, 1, 1, 1, True, 0, True, 4, False, 4, 16, 2).launch(x, dx, 2, 8, 8, 8, 8)
    with pytest.raises(ValueError, match="lanes"):  # a divisor that varies per window: not this kernel's
        AvgPool2dLanesBackward(3, 3, 1, 1, 1, 1, False, 0, False, 4, True, 4, 16, 2).launch(x, dx, 2, 8, 8, 8, 8)
    assert torch.isnan(y).all() and torch.isnan(dx).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launcher_picks_lanes_where_they_apply_and_gather_elsewhere(dtype):
    x = randn(2, 3, 8, 8, dtype=dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    for args, kwargs, forward, backward in (
        ((3, 1, 1), {}, "lanes", "lanes"),
        ((3, 1, 1), {"count_include_pad": False}, "lanes", "gather"),  # dx divisor varies per window
        ((3, 3), {}, "gather", "gather"),  # stride 3: no group of a power of two holds whole windows
    ):
        y, ref = avg_pool2d(x, *args, **kwargs), F.avg_pool2d(x64, *args, **kwargs)
        assert_close(y, ref, dtype)
        dy = randn(*ref.shape, dtype=dtype)
        x.grad = x64.grad = None
        y.backward(dy)
        ref.backward(dy.double())
        assert_close(x.grad, x64.grad, dtype)
        kernels = last_kernels("avg_pool2d")
        assert kernels["forward"][0].startswith(f"avg_pool2d_{forward}_forward")
        assert kernels["backward"][0].startswith(f"avg_pool2d_{backward}_backward")


# (shape, kernel, stride, padding, divisor_override): the suite's three windows at small sizes (odd
# OW for k3 s2), several programs per launch with the GPU's program sizes.
TUNED_CASES = [((2, 3, 12, 32), 3, 1, 1, None), ((1, 3, 28, 28), 3, 2, 0, None), ((2, 3, 12, 32), 2, 2, 0, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TUNED_CASES, ids=["k3s1p1", "k3s2", "k2s2-override"])
def test_every_tuning_candidate_is_correct(case, dtype, monkeypatch, gpu_lists):
    """Tuning picks among the GPU's candidate configs by timing, so every one must be right:
    `tuning.choose` is forced to return candidate i of the GPU's list (program sizes, warps, and
    the other lane width), forward and backward against float64."""
    shape, kernel, stride, padding, divisor = case
    x = randn(*shape, dtype=dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ref = F.avg_pool2d(x64, kernel, stride, padding, divisor_override=divisor)
    dy = randn(*ref.shape, dtype=dtype)
    ref.backward(dy.double())
    offered = {}
    for index in range(max(map(len, LANES_PROGRAMS.values())) + 1):  # every program size, and the other width
        force_choice(monkeypatch, index, offered)
        x.grad = None
        y = avg_pool2d(x, kernel, stride, padding, divisor_override=divisor)
        y.backward(dy)
        for name, ours, expected in (("y", y, ref), ("dx", x.grad, x64.grad)):
            try:
                assert_close(ours, expected, dtype)
            except AssertionError as error:
                raise AssertionError(f"candidate {index}, {name}: {error}") from None
    assert set(offered) == {"avg_pool2d_lanes_forward", "avg_pool2d_lanes_backward"}
    for kind, candidates in offered.items():
        assert len(candidates) >= 3, (kind, candidates)  # tiny shapes: bigger programs clamp to the same tile
        assert len({c.lanes for c in candidates}) == 2, f"{kind}: expected two lane widths, got {candidates}"
