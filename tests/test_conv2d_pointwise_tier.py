"""NCHW 1x1 convolutions, where the NCHW pointwise products and the channels-last kernels (through layout copies)
share a tier: every candidate a GPU would time within float64's tolerance, and quick tuning timing both kinds.

References: torch.nn.functional.conv2d and its autograd in float64 on the same data.
"""
import pytest
import torch

from nnkernels import tuning
from nnkernels.functional.conv import _listed_problem, conv2d
from nnkernels.functional.conv_algorithms import dw_pass, dx_pass, forward_pass
from support import assert_conv2d_matches_float64, dtype_id, force_choice, randn

POINTWISE = {"pointwise_forward", "pointwise_dx", "pointwise_dw"}


def _run(stride, dtype):
    x = randn(2, 32, 6, 6, dtype=dtype).requires_grad_()
    w = (randn(48, 32, 1, 1, dtype=dtype) / 32 ** 0.5).requires_grad_()
    b = randn(48, dtype=dtype).requires_grad_()
    options = (stride, 0, 1, 1)
    y = conv2d(x, w, b, *options)
    dy = randn(*y.shape, dtype=dtype)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    assert_conv2d_matches_float64(y, grads, (x, w, b), dy, options, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("stride", [1, 2])
def test_every_gpu_candidate_is_correct(stride, dtype, gpu_lists, monkeypatch, poisoned_outputs):
    """Each candidate of each pass, forced one index at a time until every list is spent: the NCHW products and
    the channels-last forward, dx and dw (and the TMA ones at stride 1) on copies of the NCHW tensors."""
    index, offered = 0, {}
    while True:
        force_choice(monkeypatch, index, offered)
        with torch.backends.cudnn.flags(allow_tf32=False):
            _run(stride, dtype)
        index += 1
        if all(len(listed) <= index for listed in offered.values()):
            break
    for kind, listed in offered.items():
        algorithms = {choice.algorithm for choice in listed}
        assert algorithms & POINTWISE and algorithms - POINTWISE, (kind, algorithms)


@pytest.mark.parametrize("size", [7, 56])
def test_quick_tuning_times_both_kinds(size, gpu_lists):
    """The candidates quick tuning times for a 1x1 layer's forward, dx and dw hold an NCHW product and a
    channels-last kernel, on small planes and on large ones."""
    p = _listed_problem((32, 512, size, size), (1024, 512, 1, 1), 1, 0, 1, 1, torch.bfloat16, False)
    for pass_ in (forward_pass(p), dx_pass(p), dw_pass(p)):
        timed = {choice.algorithm for choice in pass_.candidates()[:tuning.QUICK_CANDIDATES]}
        assert timed & POINTWISE and timed - POINTWISE, (pass_.kind, timed)
