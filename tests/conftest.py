"""Fixtures shared by the test modules (helpers live in support.py)."""
import pytest
import torch


@pytest.fixture
def exact_fp32():
    """TF32 off for the test: fp32 convolutions on both sides (ours and torch's) are IEEE fp32,
    each rounding the same way, so tight fp32 bounds are fair."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
