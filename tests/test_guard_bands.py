"""No kernel writes outside its outputs.

A store past the end (or before the start) of an output lands in whatever the caching allocator
put next to it: another tensor of the model, silently changed, so results depend on the memory
layout of the run. Poisoned outputs cannot show it (they catch elements *not* written). Here
every buffer the functional ops allocate with `torch.empty`, `torch.empty_like` or
`Tensor.new_empty` is carved out of a larger one whose margins hold a sentinel; after forward
and backward every margin must still hold it.
"""
import math

import pytest
import torch

from support import DEVICE, GPU, allocations_by_the_ops, dtype_id, randn

import nnkernels
from nnkernels import machine
from nnkernels.functional.conv_algorithms.base import GemmConfig
from nnkernels.functional.conv_algorithms.winograd import (WinogradDw, WinogradForward, winograd_candidates,
                                                           winograd_dw_candidates)
from nnkernels.functional.conv_problem import Problem
from nnkernels.ops.conv2d.winograd_transforms import tiles_of

MARGIN = 4096  # elements on each side of every allocation
SENTINEL = 4096.0  # exact in every floating type


class GuardedAllocations:
    """Stand-ins for torch's allocation functions that keep margins around each buffer."""

    def __init__(self):
        self.buffers = []

    def empty(self, size, dtype, device):
        numel = math.prod(size)
        if numel == 0:  # an allocator's template (`allocator`): holds nothing a kernel could write around
            return torch.zeros(size, dtype=dtype, device=device)
        guarded = torch.full((numel + 2 * MARGIN,), SENTINEL, dtype=dtype, device=device)
        self.buffers.append((guarded, numel, tuple(size)))
        return guarded[MARGIN:MARGIN + numel].view(size)

    def overwritten(self):
        """(shape, elements changed in the margins) of every buffer whose margins were written."""
        found = []
        for guarded, numel, shape in self.buffers:
            margins = torch.cat([guarded[:MARGIN], guarded[MARGIN + numel:]])
            changed = int((margins != SENTINEL).sum())
            if changed:
                found.append((shape, changed))
        return found


@pytest.fixture
def guarded(monkeypatch):
    """Guard the allocations made by nnkernels' functional ops (only theirs: Triton's interpreter
    allocates through the same functions for its own bookkeeping)."""
    allocations = GuardedAllocations()
    allocations_by_the_ops(monkeypatch, allocations.empty)
    return allocations


def run_conv(shape, dtype):
    batch, c_in, c_out, size, kernel, stride, padding, groups = shape
    x = randn(batch, c_in, size, size, dtype=dtype).requires_grad_()
    w = randn(c_out, c_in // groups, kernel, kernel, dtype=dtype).requires_grad_()
    b = randn(c_out, dtype=dtype).requires_grad_()
    y = nnkernels.conv2d(x, w, b, stride, padding, 1, groups)
    y.backward(torch.ones_like(y))


def run_batch_norm(shape, dtype, training):
    x = randn(*shape, dtype=dtype).requires_grad_()
    weight, bias = randn(shape[1]).requires_grad_(), randn(shape[1]).requires_grad_()
    running_mean, running_var = randn(shape[1]), randn(shape[1]).abs() + 0.5
    y = nnkernels.batch_norm(x, running_mean, running_var, weight, bias, training=training)
    y.backward(randn(*shape, dtype=dtype))


def run_pool(shape, dtype):
    x = randn(*shape, dtype=dtype).requires_grad_()
    y = nnkernels.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)
    y.backward(torch.ones_like(y))


# (batch, c_in, c_out, size, kernel, stride, padding, groups): the ResNet-18 layers of a 64 px image
# (where a run's fp32 gradients were 1e-2 off), a pointwise, a grouped and a depthwise one.
CONV_SHAPES = [(2, 16, 16, 4, 3, 1, 1, 1), (2, 16, 32, 4, 3, 2, 1, 1), (2, 16, 32, 4, 1, 2, 0, 1),
               (2, 3, 16, 9, 7, 2, 3, 1), (2, 16, 32, 5, 1, 1, 0, 1), (2, 8, 12, 5, 3, 1, 1, 2),
               (2, 8, 8, 5, 3, 1, 1, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_no_kernel_writes_outside_its_outputs(guarded, dtype):
    for shape in CONV_SHAPES:
        run_conv(shape, dtype)
    for shape in [(2, 16, 4, 4), (8, 32, 2, 2), (3, 5, 7, 6)]:
        for training in (True, False):
            run_batch_norm(shape, dtype, training)
    run_pool((2, 3, 7, 6), dtype)
    assert guarded.buffers, "no allocation went through the guarded stand-ins"
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"


@pytest.mark.skipif(DEVICE != "cuda", reason="ResNet-sized shapes: GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_no_kernel_writes_outside_its_outputs_at_resnet_sizes(guarded, dtype):
    for shape in [(8, 256, 256, 4, 3, 1, 1, 1), (8, 128, 256, 8, 3, 2, 1, 1), (8, 128, 256, 8, 1, 2, 0, 1),
                  (8, 3, 64, 64, 7, 2, 3, 1), (8, 64, 64, 16, 3, 1, 1, 1), (8, 512, 512, 2, 3, 1, 1, 1)]:
        run_conv(shape, dtype)
    for shape in [(8, 64, 32, 32), (8, 64, 16, 16), (8, 128, 8, 8), (8, 256, 4, 4), (8, 512, 2, 2)]:
        for training in (True, False):
            run_batch_norm(shape, dtype, training)
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"


def run_winograd(shape, forward_config, dw_config):
    """Winograd's forward, dx (the transposed forward) and dw with bias: the functional algorithms' runners."""
    batch, channels, size = shape
    x, w, b, dy = (randn(batch, channels, size, size), randn(channels, channels, 3, 3), randn(channels),
                   randn(batch, channels, size, size))
    device = torch.device(DEVICE)

    def problem(flip_taps=False, has_bias=True):
        return Problem(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1, torch.float32, has_bias, machine.machine_of(device),
                       tf32=False, flip_taps=flip_taps, device=device)

    WinogradForward().runner(problem(), forward_config)(x, w, b)
    WinogradForward().runner(problem(flip_taps=True, has_bias=False), forward_config)(dy, w, None)
    WinogradDw().runner(problem(), dw_config)(dy, x, None)


@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 17, 6)], ids=["odd-plane", "even-plane"])
def test_winograd_writes_only_its_outputs(guarded, shape):
    config = GemmConfig(16, 16, 16, 4, 1, split=3)
    run_winograd(shape, config, config)
    assert len(guarded.buffers) == 2 * 4 + 5, "the passes' scratch (v, u, m per forward; u, d, partial for dw) too"
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"


@pytest.mark.skipif(DEVICE != "cuda", reason="ResNet-sized shapes: GPU only")
@pytest.mark.parametrize("shape", [(8, 128, 13), (8, 512, 7), (4, 64, 56)], ids=["128@13", "512@7", "64@56"])
def test_winograd_writes_only_its_outputs_at_resnet_sizes(guarded, shape):
    """Every forward and dw candidate tuning may time."""
    batch, channels, size = shape
    forward_configs = winograd_candidates(channels, channels, GPU)
    dw_configs = winograd_dw_candidates(channels, channels, tiles_of(batch, size, size), GPU)
    for forward_config, dw_config in zip(forward_configs, dw_configs + dw_configs[-1:] * len(forward_configs)):
        run_winograd(shape, forward_config, dw_config)
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"
