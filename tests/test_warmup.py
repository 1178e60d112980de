"""`nnkernels.warmup`: every plan of a training step built ahead, the model left untouched."""
import pytest
import torch

import nnkernels
from nnkernels.step_warmup import warmup
from nnkernels.functional import common
from support import DEVICE, gpu, randn


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
    from nnkernels.layer_calls import ConvShape, conv_shapes

    model = _model().train()
    found = conv_shapes(model, (randn(2, 3, 8, 8),), training=True)
    assert found == {ConvShape((2, 3, 8, 8), (8, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, True): 1}


def test_the_meta_pass_finds_the_batch_norms_and_poolings_in_the_order_of_the_forward():
    from nnkernels.layer_calls import AvgPoolShape, BatchNormShape, ConvShape, layer_shapes

    model = _model().train()
    found = layer_shapes(model, (randn(2, 3, 8, 8),), training=True)
    assert list(found) == [
        ConvShape((2, 3, 8, 8), (8, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, True),
        BatchNormShape((2, 8, 8, 8), False, True, True),
        AvgPoolShape((2, 8, 8, 8), (2, 2), (2, 2), (0, 0), False, True, 0, False)]
    model.eval()
    assert BatchNormShape((2, 8, 8, 8), False, False, False) in layer_shapes(model, (randn(2, 3, 8, 8),))
    layer = nnkernels.convert(torch.nn.BatchNorm2d(8, track_running_stats=False))
    assert list(layer_shapes(layer, (randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last),),
                             training=True)) == [BatchNormShape((2, 8, 4, 4), True, True, False)]


def test_precompile_layers_runs_every_shape_in_worker_processes():
    """The pool's plumbing (spawned workers, shapes sent, each shape's choices launched once there); in the
    interpreter, where nothing compiles, the workers still run every choice."""
    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import precompile_layers

    shapes = [ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False),
              ConvShape((1, 8, 6, 6), (8, 1, 3, 3), (2, 2), (1, 1), (1, 1), 8, True)]
    assert precompile_layers(shapes + shapes[:1], torch.float32, jobs=2, device=DEVICE) == 2


def test_precompile_layers_runs_batch_norms_and_poolings_in_worker_processes():
    from nnkernels.layer_calls import AvgPoolShape, BatchNormShape
    from nnkernels.parallel_compile import precompile_layers

    shapes = [BatchNormShape((2, 8, 4, 4), False, True, True), BatchNormShape((2, 8, 4, 4), True, True, False),
              BatchNormShape((2, 8, 4, 4), False, False, False),
              AvgPoolShape((2, 8, 6, 6), (3, 3), (2, 2), (1, 1), True, False, 0, False)]
    assert precompile_layers(shapes, torch.bfloat16, jobs=2, device=DEVICE) == 4


def test_a_failing_precompile_worker_names_the_layer():
    from nnkernels.layer_calls import AvgPoolShape
    from nnkernels.parallel_compile import precompile_layers

    bad = AvgPoolShape((2, 8, 6, 6), (3, 3), (2, 2), (2, 2), False, True, 0, False)  # padding over half the kernel
    named = r"precompiling the forward of average pooling 3x3 s2x2 of 2x8x6x6 failed \(.*ArgumentError: padding"
    with pytest.raises(RuntimeError, match=named) as failed:
        precompile_layers([bad], torch.float32, jobs=1, device=DEVICE)
    assert "padding: expected at most half of kernel_size (3, 3)" in str(failed.value)


def test_warmup_compiles_as_it_runs_when_the_parallel_pass_fails(monkeypatch, caplog):
    from nnkernels import parallel_compile, step_warmup

    def broken(*args, **kwargs):
        raise RuntimeError("no workers here\nsecond line")

    monkeypatch.setattr(step_warmup, "INTERPRETED", False)
    monkeypatch.setattr(parallel_compile, "start_precompile", broken)
    with caplog.at_level("WARNING", logger="nnkernels"):
        summary = warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=4)
    assert summary.layers == 3 and summary.backward
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["nnkernels.warmup: compiling in 4 processes failed (RuntimeError: no workers here); "
                        "compiling as the step runs"]


@pytest.mark.parametrize("jobs", [0, 1.5, "2"])
def test_warmup_refuses_a_bad_job_count(jobs):
    with pytest.raises(ValueError, match="jobs: expected an int >= 1 or None"):
        warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=jobs)


def test_precompile_workers_do_not_rerun_the_callers_script(tmp_path):
    """Workers start with `-m`, so a training script without an `if __name__ == "__main__"` guard runs once, not
    once more per worker (as multiprocessing's spawned children would run it)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from nnkernels.layer_calls import ConvShape\n"
        "from nnkernels.parallel_compile import precompile_layers\n"
        "print('script body ran', flush=True)\n"
        "shape = ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)\n"
        f"print('done', precompile_layers([shape], torch.float32, jobs=2, device={DEVICE!r}))\n")
    finished = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.splitlines() == ["script body ran", "done 1"]


def test_a_failing_precompile_worker_names_the_shape():
    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import precompile_layers

    bad = ConvShape((1, 4, 6, 6), (8, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)  # 5 weight channels for 4
    named = r"precompiling the forward of the convolution 3x3 4->8 6x6 p1 failed \(.*w: expected"
    with pytest.raises(RuntimeError, match=named) as failed:
        precompile_layers([bad], torch.float32, jobs=1, device=DEVICE)
    assert "w: expected C_OUT*(C_IN/G)*KH*KW = 288 elements, got 360" in str(failed.value)


def test_stopped_precompile_workers_end_at_once():
    """`stop` kills the workers wherever they are (here still importing torch), and no shape counts as failed."""
    import time

    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import start_precompile

    shapes = [ConvShape((1, 4, 6, 6 + i), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False) for i in range(6)]
    compiling = start_precompile(shapes, torch.float32, jobs=2, device=DEVICE)
    began = time.perf_counter()
    compiling.stop()
    assert time.perf_counter() - began < 5
    assert compiling.failures == [] and all(child.poll() is not None for child in compiling._children)


def test_warmup_stops_its_compiling_processes_when_the_step_is_done(monkeypatch):
    from nnkernels import parallel_compile, step_warmup

    started, real_start = [], parallel_compile.start_precompile

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(step_warmup, "INTERPRETED", False)
    monkeypatch.setattr(parallel_compile, "start_precompile", start)
    summary = warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=2)
    assert summary.layers == 3 and summary.backward and len(started) == 1
    # the convolution, the batch norm and the pooling, in the order of the forward
    assert [shape.x_shape for shape in started[0].shapes] == [(2, 3, 8, 8), (2, 8, 8, 8), (2, 8, 8, 8)]
    assert all(child.poll() is not None for child in started[0]._children)


@gpu
def test_compile_only_launches_compile_and_write_nothing(monkeypatch, poisoned_outputs):
    """`parallel_compile`'s workers only fill Triton's cache: a launch there leaves its output as it was."""
    from nnkernels import kernel
    from nnkernels.functional.layout import channels_last

    x = randn(2, 16, 5, 7)
    monkeypatch.setattr(kernel, "_COMPILE_ONLY", True)
    assert torch.isnan(channels_last(x)).all()
    monkeypatch.setattr(kernel, "_COMPILE_ONLY", False)
    assert torch.equal(channels_last(x), x.permute(0, 2, 3, 1).contiguous())


def test_the_meta_pass_marks_channels_last_calls():
    """A channels-last model's calls are recorded as such, so warmup's workers compile the channels-last choices."""
    from nnkernels.layer_calls import conv_shapes

    model = _model().train().to(memory_format=torch.channels_last)
    found = conv_shapes(model, (randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),), training=True)
    assert [shape.channels_last for shape in found] == [True]


def test_workers_take_the_forwards_in_the_steps_order_then_the_backwards_in_reverse():
    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import job_order

    assert job_order(["a", "b", "c"]) == [("a", "forward"), ("b", "forward"), ("c", "forward"), ("c", "backward"),
                                          ("b", "backward"), ("a", "backward")]
    conv = ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    # a convolution's backward is two jobs, so that two workers build its dw and dx at once
    assert job_order(["a", conv]) == [("a", "forward"), (conv, "forward"), (conv, "dw"), (conv, "dx"),
                                      ("a", "backward")]


def test_a_worker_that_dies_is_replaced_and_the_other_shapes_still_compile():
    """A crash (here a kill) costs the shape its worker held, not the rest of the queue: the step would otherwise
    compile every remaining kernel itself (an H100 run once took 101 s instead of 32 that way)."""
    import time

    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import start_precompile

    shapes = [ConvShape((1, 4, 6, 6 + i), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False) for i in range(4)]
    compiling = start_precompile(shapes, torch.float32, jobs=2, device=DEVICE)
    while not compiling._children:
        time.sleep(0.01)
    compiling._children[0].kill()
    with pytest.raises(RuntimeError, match=r"precompiling the forward of the convolution 3x3 4->8 6x\d+ p1 failed "
                                           r"\(its process ended with exit status -9\)"):
        compiling.wait()
    # a forward, a dw and a dx job per shape, the killed worker's job lost
    assert len(compiling.jobs) == 3 * len(shapes)
    assert len(compiling.failures) == 1 and len(set(compiling.compiled)) == len(compiling.jobs) - 1


def test_a_job_this_process_claims_leaves_the_queue():
    """The step's own first call takes a queued job: no worker compiles it later, beside or after the step."""
    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import job_order, start_precompile

    shapes = [ConvShape((1, 4, 6, 6 + i), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False) for i in range(2)]
    compiling = start_precompile(shapes, torch.float32, jobs=1, device=DEVICE)
    last = job_order(shapes)[-1]
    compiling.claim(last)
    assert compiling.wait() == 2
    assert compiling.claimed == [last] and last not in compiling.compiled
    assert sorted(map(repr, compiling.compiled)) == sorted(map(repr, job_order(shapes)[:-1]))


def test_a_job_this_process_drops_leaves_the_queue_and_a_held_one_is_not_waited_for():
    """A pass the step will not run (the first convolution's dx) is compiled by no one where still queued; where a
    worker holds it, dropping returns at once."""
    import time

    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import job_order, start_precompile

    shapes = [ConvShape((1, 4, 6, 6 + i), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False) for i in range(2)]
    compiling = start_precompile(shapes, torch.float32, jobs=1, device=DEVICE)
    first, last = job_order(shapes)[0], job_order(shapes)[-1]
    deadline = time.monotonic() + 60
    while first not in compiling._held:
        assert time.monotonic() < deadline, "no worker took the first job"
        time.sleep(0.01)
    began = time.perf_counter()
    compiling.drop(first)
    compiling.drop(last)
    assert time.perf_counter() - began < 1
    assert compiling.wait() == 2
    assert compiling.dropped == [last] and last not in compiling.compiled and first in compiling.compiled
    assert sorted(map(repr, compiling.compiled)) == sorted(map(repr, job_order(shapes)[:-1]))


def test_a_claim_waits_for_the_job_a_worker_holds():
    """A job a worker is compiling is waited for, not compiled a second time beside it."""
    import time

    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import job_order, start_precompile

    shapes = [ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)]
    compiling = start_precompile(shapes, torch.float32, jobs=1, device=DEVICE)
    first = job_order(shapes)[0]
    deadline = time.monotonic() + 60
    while first not in compiling._held:
        assert time.monotonic() < deadline, "no worker took the first job"
        time.sleep(0.01)
    compiling.claim(first)
    assert first in compiling.compiled and compiling.claimed == []
    compiling.stop()


def test_a_claim_on_stopped_workers_returns_at_once():
    """A job held by a killed worker, or never taken, is not waited for: the step compiles it."""
    import time

    from nnkernels.layer_calls import ConvShape
    from nnkernels.parallel_compile import job_order, start_precompile

    shapes = [ConvShape((1, 4, 6, 6), (8, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)]
    compiling = start_precompile(shapes, torch.float32, jobs=1, device=DEVICE)
    compiling.stop()
    began = time.perf_counter()
    compiling.claim(job_order(shapes)[0], timeout=60)
    assert time.perf_counter() - began < 5


def test_the_steps_first_calls_claim_their_layers_jobs(monkeypatch):
    """Every job of the step (the convolution's, the batch norm's, the pooling's) is compiled once: by a worker, or
    by the step that claimed it first. The layer calls' jobs are the ones the meta pass queued."""
    from nnkernels import parallel_compile, step_warmup

    started, real_start = [], parallel_compile.start_precompile

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    common.clear_plans()
    monkeypatch.setattr(step_warmup, "INTERPRETED", False)
    monkeypatch.setattr(parallel_compile, "start_precompile", start)
    warmup(_model(), randn(2, 3, 8, 8), progress=False, jobs=2)
    compiled, claimed, dropped = started[0].compiled, started[0].claimed, started[0].dropped
    assert not set(compiled) & set(claimed) and not (set(compiled) | set(claimed)) & set(dropped)
    assert set(compiled) | set(claimed) | set(dropped) == set(parallel_compile.job_order(started[0].shapes))
    # the first convolution's input takes no gradient: its dx is compiled by no one, or by a worker that got there
    first_dx = (started[0].shapes[0], "dx")
    assert first_dx in dropped or first_dx in compiled
