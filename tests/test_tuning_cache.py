"""The tuning cache on disk: processes that tune at once keep every choice, and an unreadable file is ignored."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Saves N choices of its own, starting once both writers are ready: without the file lock, two of these lost
# about half of the 300 choices on a 2-core machine.
WRITER = """
import sys, time
from dataclasses import dataclass
from nnkernels import tuning

@dataclass(frozen=True)
class Choice:
    tile: int

folder = tuning.cache_path().parent
(folder / f"ready-{sys.argv[1]}").touch()
while len(list(folder.glob("ready-*"))) < 2:
    time.sleep(0.001)
for i in range(int(sys.argv[2])):
    tuning._save(f"{sys.argv[1]} {i}", Choice(i))
"""


def test_two_processes_saving_at_once_keep_every_choice(tmp_path):
    env = {**os.environ, "NNKERNELS_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, "150"], env=env, stderr=subprocess.PIPE,
                                text=True) for name in ("first", "second")]
    for writer in writers:
        assert writer.wait(timeout=300) == 0, writer.stderr.read()
    stored = json.loads((tmp_path / "tuning.json").read_text())
    assert stored == {f"{name} {i}": {"tile": i} for name in ("first", "second") for i in range(150)}


def test_an_unreadable_cache_is_ignored_with_one_warning(tmp_path, caplog):
    from nnkernels import tuning

    path = tmp_path / "tuning.json"
    path.write_text("{ not json")
    with caplog.at_level("WARNING", logger="nnkernels"):
        assert tuning._read(path) == {}
    assert len(caplog.records) == 1 and "not a readable tuning cache" in caplog.records[0].getMessage()


def _stored_passes():
    """(kind, key, candidates, decode) of batch norm's split and grouped passes and pooling's lanes pass (its gather
    pass takes one config from a rule: nothing to store), as their plans ask tuning, on the test GPU's lists."""
    import torch

    from nnkernels.functional.batchnorm_algorithms import BatchNormProblem
    from nnkernels.functional.pooling_algorithms import PoolingPass
    from support import GPU

    found = []
    for shape in ((64, 64, 56, 56), (64, 2048, 7, 7)):  # split, grouped
        problem = BatchNormProblem(shape, torch.bfloat16, torch.device("cpu"), GPU)
        candidates, decode = problem.candidates("train_forward")
        found.append((problem.kind("train_forward"), problem.key, candidates(), decode))
    pass_ = PoolingPass("forward", torch.bfloat16, 64 * 64, 56, 56, 28, 28, (3, 3), (2, 2), (1, 1), True, None, GPU,
                        torch.device("cpu"))
    found.append((pass_.kind, pass_.key, pass_.candidates(), pass_.decode))
    return found


def test_stored_batch_norm_and_pooling_choices_read_back(tmp_path, monkeypatch, caplog):
    """A choice tuning stored is the choice a later process reads (these once came back unreadable, and every
    process tuned batch norm and pooling again)."""
    from nnkernels import tuning

    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "mode", lambda: "quick")
    passes = _stored_passes()
    assert all(len(listed) > 1 for _, _, listed, _ in passes)
    for kind, key, listed, _ in passes:
        tuning._save(tuning._full_key(kind, key), listed[-1])
    with caplog.at_level("WARNING", logger="nnkernels"):
        for kind, key, listed, decode in passes:
            assert tuning.peek(kind, key, listed, decode) == listed[-1], kind
    assert not caplog.records, [record.getMessage() for record in caplog.records]


def test_past_the_budget_each_algorithm_still_has_its_first_candidate_timed(tmp_path, monkeypatch):
    """A first candidate whose compiling outlasts the budget does not win unopposed: an H200 run once kept a
    channels-last depthwise 5x5 dx (3.8 ms there; 5 ms timed alone on an H100) over the NCHW kernel (45 µs on
    the H100) that the budget left untimed."""
    from dataclasses import dataclass

    import torch

    from nnkernels import tuning

    @dataclass(frozen=True)
    class Choice:
        algorithm: str
        tile: int

    slow, slow_wider, fast, fast_wider = Choice("a", 1), Choice("a", 2), Choice("b", 1), Choice("b", 2)
    times = {slow: 5.0, slow_wider: 6.0, fast: 0.05, fast_wider: 0.01}
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "mode", lambda: "full")
    monkeypatch.setattr(tuning, "TUNING_BUDGET_S", 0.0)  # every candidate after the first is past the budget
    monkeypatch.setattr(tuning, "_time_ms", lambda run, choice: times[choice])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ran = []
    chosen = tuning.choose("test_budget", ("shape",), lambda: [slow, slow_wider, fast, fast_wider], ran.append,
                           lambda stored: Choice(**stored))
    assert ran == [slow, fast] and chosen == fast


def test_a_process_compiling_for_another_runs_what_its_tuning_would_time_and_times_nothing(tmp_path, monkeypatch):
    """`compile_for(mode)`: the remembered choice where there is one, else the candidates that mode times, each run
    once (so compiled), none timed or remembered; the answer is the first guess."""
    from dataclasses import dataclass

    from nnkernels import tuning

    @dataclass(frozen=True)
    class Choice:
        tile: int

    listed = [Choice(tile) for tile in range(5)]
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_time_ms", lambda run, choice: pytest.fail("timed in a compiling process"))
    for mode, expected in (("quick", listed[:tuning.QUICK_CANDIDATES]), ("full", listed), ("off", listed[:1])):
        monkeypatch.setattr(tuning, "_compiling_for", mode)
        ran = []
        chosen = tuning.choose("test_compile_for", (mode,), lambda: listed, ran.append, lambda s: Choice(**s))
        assert chosen == listed[0]
        assert ran == expected, mode
    assert not (tmp_path / "tuning.json").exists()
    tuning._save(tuning._full_key("test_compile_for", ("known",)), listed[3])
    monkeypatch.setattr(tuning, "_memory", None)  # read the file again
    monkeypatch.setattr(tuning, "_compiling_for", "quick")
    ran = []
    assert tuning.choose("test_compile_for", ("known",), lambda: listed, ran.append, lambda s: Choice(**s)) == listed[3]
    assert ran == [listed[3]]
