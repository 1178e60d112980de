"""The tuning cache on disk: processes that tune at once keep every choice, and an unreadable file is ignored."""
import json
import os
import subprocess
import sys
from pathlib import Path

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
