"""Fixtures shared by the test modules (helpers live in support.py)."""
import pytest
import torch

from nnkernels import machine
from nnkernels.functional import clear_plans
from support import GPU, allocations_by_the_ops


@pytest.fixture
def exact_fp32():
    """TF32 off for the test: fp32 convolutions on both sides (ours and torch's) are IEEE fp32,
    each rounding the same way, so tight fp32 bounds are fair."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test builds its own plans: a plan made under one test's monkeypatched choices must not serve another."""
    yield
    clear_plans()


@pytest.fixture
def gpu_lists(monkeypatch):
    """The candidate lists of a compiled process on a 132-SM GPU with a TMA unit (`support.GPU`), in whatever
    process the test runs: every op's plans ask `machine_of` for the machine they run on."""
    monkeypatch.setattr(machine, "machine_of", lambda device: GPU)
    clear_plans()
    yield GPU
    clear_plans()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer the functional ops allocate starts full of NaN (the largest finite value for types without
    one), so an element no kernel writes fails the comparison with the reference."""
    def allocate(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)

    allocations_by_the_ops(monkeypatch, allocate)
