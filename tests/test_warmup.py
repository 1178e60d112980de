"""`nnkernels.warmup`: every plan of a training step built ahead, the model left untouched."""
import pytest
import torch

import nnkernels
from nnkernels.step_warmup import warmup
from nnkernels.functional import common
from support import DEVICE, randn


def _model():
    torch.manual_seed(0)
    return nnkernels.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                                 torch.nn.ReLU(inplace=True), torch.nn.AvgPool2d(2))).to(DEVICE)


def _plans():
    return sum(len(cache._plans) for cache in common._CACHES)


def test_warmup_builds_the_steps_plans_and_leaves_the_model_as_it_was():
    model, x = _model(), randn(2, 3, 8, 8)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before = _plans()
    summary = warmup(model, x, progress=False)
    assert summary.layers == 3 and summary.backward and _plans() > before
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    built = _plans()
    model(x).sum().backward()  # the real step finds every plan
    assert _plans() == built


def test_warmup_with_a_bad_input_raises_what_the_model_raises():
    model = _model()
    with pytest.raises(RuntimeError) as from_model:
        model(randn(2, 4, 8, 8))
    with pytest.raises(RuntimeError) as from_warmup:
        warmup(model, randn(2, 4, 8, 8), progress=False)
    assert str(from_warmup.value) == str(from_model.value)
