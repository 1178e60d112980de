"""Compiling ahead at a converted model's first forward: started once with the step's convolutions, stopped at the
next forward, skipped where a marker says it is done, off on request, and invisible to the model's results."""
import copy
import io
import time

import pytest
import torch

import nnkernels
from nnkernels import compile_ahead, step_warmup
from nnkernels.layer_calls import layer_shapes
from support import DEVICE, randn


class FakeCompiling:
    """What `start_compiling_shapes` returns, recording what it was asked."""

    def __init__(self, shapes, dtype, jobs, device, who, complete=True):
        self.shapes, self.dtype, self.jobs, self.device, self.complete = shapes, dtype, jobs, device, complete
        self.failures, self.stopped = [], False

    def finished(self):
        return self.complete and not self.stopped

    def stop(self):
        self.stopped = True


def _model():
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
              torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), torch.nn.AvgPool2d(2)]
    return nnkernels.convert(torch.nn.Sequential(*layers)).to(DEVICE)


@pytest.fixture
def ahead(monkeypatch, tmp_path):
    """Compiling ahead as on a GPU, on this test's device and in a Triton cache of its own; the starts it makes."""
    monkeypatch.setattr(compile_ahead, "INTERPRETED", False)
    monkeypatch.setattr(compile_ahead, "GPU_DEVICE_TYPES", (torch.device(DEVICE).type,))
    monkeypatch.setattr(compile_ahead, "_triton_cache_dir", lambda: tmp_path / "triton")
    monkeypatch.delenv(compile_ahead.ENV, raising=False)
    monkeypatch.setenv(compile_ahead.JOBS_ENV, "4")  # as on a machine of several CPUs, whatever this one has
    started = []

    def start(*args, **kwargs):
        started.append(FakeCompiling(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(step_warmup, "start_compiling_shapes", start)
    return started


def test_the_first_forward_starts_compiling_the_steps_layers_and_the_next_stops_it(ahead):
    model, x = _model(), randn(2, 3, 8, 8)
    expected = list(layer_shapes(copy.deepcopy(model), (x,), training=True))
    model(x).sum().backward()
    # two convolutions, the batch norm and the pooling, in the order of the forward
    assert len(ahead) == 1 and ahead[0].shapes == expected and len(expected) == 4
    assert ahead[0].dtype == torch.float32 and ahead[0].device == str(x.device) and not ahead[0].stopped
    # The second step's forward stops the workers; on a GPU the first step's backward has tuned (the marker's key
    # holds the convolutions' remembered choices) before the marker is written.
    model(x).sum().backward()
    assert ahead[0].stopped
    model(x)
    assert len(ahead) == 1
    # The workers had compiled every shape: another process (here another model of the same shapes) starts none.
    _model()(x)
    assert len(ahead) == 1


def test_a_process_that_ends_after_one_step_stops_the_workers_and_leaves_the_marker(ahead, monkeypatch):
    at_exit = []
    monkeypatch.setattr(compile_ahead.atexit, "register", at_exit.append)
    model, x = _model(), randn(2, 3, 8, 8)
    model(x).sum().backward()
    assert len(at_exit) == 1 and not ahead[0].stopped
    at_exit[0]()
    assert ahead[0].stopped
    at_exit[0]()  # the second forward and the exit both finish: only the first does anything
    model(x)
    _model()(x)
    assert len(ahead) == 1


def test_workers_stopped_before_they_finished_leave_no_marker(ahead, monkeypatch):
    monkeypatch.setattr(FakeCompiling, "finished", lambda self: False)
    x = randn(2, 3, 8, 8)
    model = _model()
    model(x)
    model(x)
    _model()(x)
    assert len(ahead) == 2 and ahead[0].stopped


def test_the_marker_follows_the_convolutions_remembered_choices_only(ahead, monkeypatch, tmp_path):
    from nnkernels import tuning
    from nnkernels.functional import conv

    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path / "tuning"))
    x = randn(2, 3, 8, 8)
    model = _model()
    model(x)
    model(x)
    # Another op's tuning rewrites the cache; the convolutions' kernels are the same, and so is the marker.
    tuning.cache_path().parent.mkdir(parents=True, exist_ok=True)
    tuning.cache_path().write_text('{"batch_norm_train_forward": {}}')
    _model()(x)
    assert len(ahead) == 1
    # A convolution's remembered choice changes what compiling ahead compiles: a new model compiles again.
    remembered = conv.remembered_choices
    monkeypatch.setattr(conv, "remembered_choices", lambda *args: ("another",) + remembered(*args)[1:])
    _model()(x)
    assert len(ahead) == 2


def test_another_input_shape_compiles_ahead_again(ahead):
    x = randn(2, 3, 8, 8)
    model = _model()
    model(x)
    model(x)
    _model()(randn(4, 3, 8, 8))
    assert len(ahead) == 2


def test_off_when_asked_and_after_warmup(ahead, monkeypatch):
    x = randn(2, 3, 8, 8)
    monkeypatch.setenv(compile_ahead.ENV, "off")
    _model()(x)
    assert ahead == []
    monkeypatch.delenv(compile_ahead.ENV)
    model = _model()
    nnkernels.warmup(model, x, progress=False, jobs=1)
    model(x)
    assert ahead == []


def test_the_number_of_processes_is_one_per_cpu_or_what_the_environment_says(ahead, monkeypatch):
    monkeypatch.delenv(compile_ahead.JOBS_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert compile_ahead.background_jobs() == max(1, compile_ahead.default_jobs(compile_ahead.MOST_JOBS) // 2)
    monkeypatch.setenv(compile_ahead.JOBS_ENV, "12")
    assert compile_ahead.background_jobs() == 12
    monkeypatch.setenv(compile_ahead.JOBS_ENV, "1")  # none, as warmup(jobs=1): the step compiles as it goes
    _model()(randn(2, 3, 8, 8))
    assert ahead == []
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(compile_ahead.JOBS_ENV, bad)
        with pytest.raises(ValueError, match=compile_ahead.JOBS_ENV):
            compile_ahead.background_jobs()


def test_results_are_the_models_own_and_a_bad_input_raises_its_error(ahead, monkeypatch):
    x = randn(2, 3, 8, 8)
    hooked_y = _model()(x)
    monkeypatch.setenv(compile_ahead.ENV, "off")
    without = _model()
    assert torch.equal(hooked_y, without(x))
    monkeypatch.delenv(compile_ahead.ENV)
    fresh = _model()
    with pytest.raises(RuntimeError) as from_model:
        without(randn(2, 4, 8, 8))
    with pytest.raises(RuntimeError) as from_hooked:
        fresh(randn(2, 4, 8, 8))
    assert str(from_hooked.value) == str(from_model.value)
    assert len(ahead) == 1  # with_hook's first forward; the failed meta pass started nothing


def test_a_copied_or_saved_model_compiles_ahead_afresh(ahead):
    model, x = _model(), randn(2, 3, 8, 8)
    model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    hooks = [h for m in (loaded, twin) for h in m._forward_pre_hooks.values()]
    assert len(hooks) == 2 and all(isinstance(h, compile_ahead.CompileAhead) and h.forwards == 0 for h in hooks)
    nnkernels.convert(model)  # converting again adds no second hook
    assert sum(isinstance(h, compile_ahead.CompileAhead) for h in model._forward_pre_hooks.values()) == 1


def test_real_workers_compile_ahead_and_leave_the_marker(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_ahead, "INTERPRETED", False)
    monkeypatch.setattr(compile_ahead, "GPU_DEVICE_TYPES", (torch.device(DEVICE).type,))
    monkeypatch.setattr(compile_ahead, "_triton_cache_dir", lambda: tmp_path / "triton")
    monkeypatch.setenv(compile_ahead.JOBS_ENV, "2")
    model, x = _model(), randn(2, 3, 8, 8)
    model(x)
    hook = next(iter(model._forward_pre_hooks.values()))
    compiling = hook.compiling
    began = time.perf_counter()
    while not compiling.finished() and time.perf_counter() - began < 240:
        time.sleep(0.2)
    assert compiling.finished() and compiling.failures == []
    model(x)
    assert all(child.poll() is not None for child in compiling._children)
    assert len(list((tmp_path / "triton" / "nnkernels-compiled-ahead").iterdir())) == 1


def test_workers_take_at_most_a_quarter_of_the_free_gpu_memory():
    from nnkernels.layer_calls import ConvShape

    shape = ConvShape((64, 256, 56, 56), (256, 256, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    per_worker = compile_ahead.WORKER_CONTEXT_BYTES + 4 * 2 * (2 * 64 * 256 * 56 * 56 + 256 * 256 * 9)
    assert compile_ahead.affordable_jobs(8, None, [shape], torch.bfloat16) == 8
    assert compile_ahead.affordable_jobs(8, 140 * 2**30, [shape], torch.bfloat16) == 8
    assert compile_ahead.affordable_jobs(8, 3 * 4 * per_worker + 1, [shape], torch.bfloat16) == 3
    assert compile_ahead.affordable_jobs(8, 4 * per_worker - 1, [shape], torch.bfloat16) == 0


def test_the_meta_pass_copies_no_parameter_data():
    from nnkernels.layer_calls import meta_copy

    model = _model().to(memory_format=torch.channels_last)
    model[0].weight.requires_grad_(False)
    twin = meta_copy(model)
    pairs = list(zip(model.state_dict().values(), twin.state_dict().values()))
    assert all(t.is_meta and t.shape == o.shape and t.dtype == o.dtype and t.stride() == o.stride() for o, t in pairs)
    assert [p.requires_grad for p in twin.parameters()] == [p.requires_grad for p in model.parameters()]
    assert all(not t.is_meta for t in model.state_dict().values())  # the model itself is untouched
