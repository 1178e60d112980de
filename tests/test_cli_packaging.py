"""Packaging: matplotlib and scikit-learn are the demo extra's, torchvision the bench extra's; `make test` and
`make demo` install what each needs on a fresh clone, and again when pyproject.toml changes."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nnkernels.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_and_bench_libraries_are_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda requirements: {r.split(">")[0].split("=")[0].split("[")[0] for r in requirements}  # noqa: E731
    assert not names(project["dependencies"]) & {"matplotlib", "scikit-learn", "torchvision"}
    extras = project["optional-dependencies"]
    assert names(extras["demo"]) == {"matplotlib", "scikit-learn"}
    assert names(extras["bench"]) == {"matplotlib", "torchvision"}
    assert {"matplotlib", "scikit-learn", "pytest"} <= names(extras["test"])  # the suite runs the demo


def dry_run(folder: Path, target: str) -> str:
    # Under `make test` (CI) the parent make's variables would make this one print its directory changes.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=folder, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_installs_the_test_and_demo_dependencies_once_and_after_pyproject_changes(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    fresh_test, fresh_demo = dry_run(tmp_path, "test"), dry_run(tmp_path, "demo")
    assert "pip install -q -e '.[test]'" in fresh_test and "[demo]" not in fresh_test
    assert "pip install -q -e '.[test]'" in fresh_demo and "pip install -q -e '.[demo]'" in fresh_demo
    assert fresh_demo.strip().endswith("nnkernels demo")
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / ".nnkernels-installed").touch()
    (venv / ".nnkernels-demo-installed").touch()
    assert "pip" not in dry_run(tmp_path, "demo")  # installed: nothing to do but run
    later = time.time() + 5
    os.utime(tmp_path / "pyproject.toml", (later, later))
    again = dry_run(tmp_path, "demo")
    assert "'.[test]'" in again and "'.[demo]'" in again


def test_bench_without_its_extra_says_what_to_install(capsys, monkeypatch):
    from nnkernels.bench import harness

    monkeypatch.setattr(harness, "require_gpu", lambda: None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exited:
        main(["bench", "conv2d"])
    _, err = capsys.readouterr()
    assert exited.value.code == 1
    assert "matplotlib" in err and "pip install 'nnkernels[bench]'" in err
