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


def test_the_meta_pass_finds_the_converted_models_convolutions_in_training():
    from nnkernels.conv_calls import ConvShape, conv_shapes

    model = _model().train()
    found = conv_shapes(model, (randn(2, 3, 8, 8),), training=True)
    assert found == {ConvShape((2, 3, 8, 8), (8, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, True): 1}


def test_precompile_convs_runs_every_shape_in_worker_processes():
    """The pool's plumbing (spawned workers, shapes sent, each shape's choices launched once there); in the
    interpreter, where nothing compiles, the workers still run every choice."""
    from nnkernels.conv_calls import ConvShape
    from nnkernels.parallel_compile import precompile_convs

    shapes = [ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False),
              ConvShape((1, 8, 6, 6), (8, 1, 3, 3), (2, 2), (1, 1), (1, 1), 8, True)]
    assert precompile_convs(shapes + shapes[:1], torch.float32, jobs=2, device=DEVICE) == 2


def test_warmup_compiles_as_it_runs_when_the_parallel_pass_fails(monkeypatch, caplog):
    from nnkernels import parallel_compile, step_warmup

    def broken(*args, **kwargs):
        raise RuntimeError("no workers here\nsecond line")

    monkeypatch.setattr(step_warmup, "INTERPRETED", False)
    monkeypatch.setattr(parallel_compile, "precompile_convs", broken)
    with caplog.at_level("WARNING", logger="nnkernels"):
        summary = warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=4)
    assert summary.layers == 3 and summary.backward
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["nnkernels.warmup: compiling in 4 processes failed (RuntimeError: no workers here); "
                        "compiling as the step runs"]


@pytest.mark.parametrize("jobs", [0, 1.5, "2"])
def test_warmup_refuses_a_bad_job_count(jobs):
    with pytest.raises(ValueError, match="jobs: expected an int >= 1"):
        warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=jobs)
