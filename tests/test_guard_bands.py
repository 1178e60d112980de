"""No kernel writes outside its outputs.

A store past the end (or before the start) of an output lands in whatever the caching allocator
put next to it: another tensor of the model, silently changed, so results depend on the memory
layout of the run. Poisoned outputs cannot show it (they catch elements *not* written). Here
every buffer the functional ops allocate with `torch.empty`, `torch.empty_like` or
`Tensor.new_empty` is carved out of a larger one whose margins hold a sentinel; after forward
and backward every margin must still hold it.
"""
import math
import sys

import pytest
import torch

from support import DEVICE, dtype_id, randn

import nnkernels
from nnkernels import tuning
from nnkernels.functional import winograd
from nnkernels.ops.conv2d.winograd_transforms import tiles_of

MARGIN = 4096  # elements on each side of every allocation
SENTINEL = 4096.0  # exact in every floating type


class GuardedAllocations:
    """Stand-ins for torch's allocation functions that keep margins around each buffer."""

    def __init__(self):
        self.buffers = []

    def empty(self, *size, dtype=None, device=None, **_ignored):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        dtype = dtype or torch.get_default_dtype()
        numel = math.prod(size)
        guarded = torch.full((numel + 2 * MARGIN,), SENTINEL, dtype=dtype, device=device)
        self.buffers.append((guarded, numel, tuple(size)))
        return guarded[MARGIN:MARGIN + numel].view(size)

    def empty_like(self, t, *, dtype=None, device=None, **_ignored):
        return self.empty(*t.shape, dtype=dtype or t.dtype, device=device or t.device)

    def new_empty(self, t, *size, dtype=None, device=None, **_ignored):
        return self.empty(*size, dtype=dtype or t.dtype, device=device or t.device)

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

    def only_for_the_ops(original, guarded_version):
        def allocate(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return (guarded_version if caller.startswith("nnkernels.functional") else original)(*args, **kwargs)
        return allocate

    monkeypatch.setattr(torch, "empty", only_for_the_ops(torch.empty, allocations.empty))
    monkeypatch.setattr(torch, "empty_like", only_for_the_ops(torch.empty_like, allocations.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", only_for_the_ops(torch.Tensor.new_empty, allocations.new_empty))
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


def run_winograd(guarded, shape, forward_config, dw_config):
    """Winograd's forward, dx (the transposed forward) and dw with bias, into guarded outputs."""
    batch, channels, size = shape
    x, w, b, dy = (randn(batch, channels, size, size), randn(channels, channels, 3, 3), randn(channels),
                   randn(batch, channels, size, size))
    outputs = [guarded.empty(*t.shape, dtype=torch.float32, device=DEVICE) for t in (x, x, w, b)]
    winograd.forward(x, w, b, outputs[0], forward_config)
    winograd.forward(dy, w, None, outputs[1], forward_config, transposed=True)
    winograd.weight_gradient(dy, x, outputs[2], outputs[3], dw_config)


@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 17, 6)], ids=["odd-plane", "even-plane"])
def test_winograd_writes_only_its_outputs(guarded, shape):
    config = tuning.Config(16, 16, 16, 4, 1, split=3, winograd=True)
    run_winograd(guarded, shape, config, config)
    assert len(guarded.buffers) == 4 + 9, "the passes' scratch (v, u, m per forward; u, d, partial for dw) too"
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"


@pytest.mark.skipif(DEVICE != "cuda", reason="ResNet-sized shapes: GPU only")
@pytest.mark.parametrize("shape", [(8, 128, 13), (8, 512, 7), (4, 64, 56)], ids=["128@13", "512@7", "64@56"])
def test_winograd_writes_only_its_outputs_at_resnet_sizes(guarded, shape):
    """Every forward and dw candidate tuning may time."""
    batch, channels, size = shape
    forward_configs = tuning.winograd_candidates(channels, channels)
    dw_configs = tuning.winograd_dw_candidates(channels, channels, tiles_of(batch, size, size))
    for forward_config, dw_config in zip(forward_configs, dw_configs + dw_configs[-1:] * len(forward_configs)):
        run_winograd(guarded, shape, forward_config, dw_config)
    assert not guarded.overwritten(), f"written outside the buffer (shape, elements): {guarded.overwritten()}"
