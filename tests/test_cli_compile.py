"""`nnkernels compile` in parallel: the same PTX as one compiler process, the targets in --help, progress."""
import os
import subprocess
import sys

import pytest

from nnkernels import Avgpool2dBackward, Avgpool2dForward
from nnkernels._aot import compile_in_subprocess
from nnkernels.cli import COMPILE_TARGETS, main
from nnkernels.kernel import COMPILE_TARGETS as KERNEL_TARGETS


def test_help_lists_the_targets_the_kernels_build_for(capsys):
    assert COMPILE_TARGETS == tuple(f"sm_{c}" for c in KERNEL_TARGETS)
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"GPU architecture: {', '.join(COMPILE_TARGETS)}." in help_text
    assert "--jobs" in help_text


def test_parallel_builds_are_the_serial_builds(monkeypatch, tmp_path):
    kernels = [Avgpool2dForward.example(), Avgpool2dBackward.example(), Avgpool2dForward(3, 3, 1, 1, 32)]
    # Each run gets its own empty Triton cache, so neither reads what the other compiled.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "serial"))
    serial = compile_in_subprocess(kernels, "sm_80", jobs=1)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "parallel"))
    done = []
    parallel = compile_in_subprocess(kernels, "sm_80", jobs=2, on_done=lambda k: done.append(k.id))
    assert sorted(done) == sorted(k.id for k in kernels)
    assert [b.name for b in parallel] == [k.entry_point_name for k in kernels]
    for one, other in zip(serial, parallel):
        assert one.ptx == other.ptx and one.cubin == other.cubin and one == other
    assert serial[0].ptx != serial[2].ptx  # the results are each kernel's own, in order


def test_a_failing_kernel_is_one_error_naming_it(monkeypatch):
    kernel = Avgpool2dForward.example()
    monkeypatch.setattr(type(kernel), "__module__", "nnkernels.no_such_module")
    with pytest.raises(RuntimeError, match=rf"(?s)compiling {kernel.id} for sm_90 failed:.*no_such_module"):
        compile_in_subprocess([kernel], "sm_90", jobs=2)


def _run_compiled(code: str, tmp_path) -> subprocess.CompletedProcess:
    """`code` in a new interpreter that runs Triton compiled (as `nnkernels compile` does), with its own cache."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_command_forks_its_compilers_and_builds_what_one_compiler_builds(monkeypatch, tmp_path):
    kernels = [Avgpool2dForward.example(), Avgpool2dBackward.example()]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "serial"))
    serial = compile_in_subprocess(kernels, "sm_80", jobs=1)
    out = tmp_path / "out"
    code = ("import nnkernels._aot as aot; assert aot._can_fork(); from nnkernels.cli import main; "
            f"raise SystemExit(main(['compile', '--target', 'sm_80', '--jobs', '2', '--out', {str(out)!r}, "
            "'Avgpool2dForward', 'Avgpool2dBackward']))")
    done = _run_compiled(code, tmp_path)
    assert done.returncode == 0, done.stderr
    for kernel, built in zip(kernels, serial):
        assert (out / f"{kernel.id}.ptx").read_text() == built.ptx
        assert (out / f"{kernel.id}.cubin").read_bytes() == built.cubin


def test_a_kernel_failing_in_a_forked_compiler_is_one_error_naming_it(tmp_path):
    code = ("import nnkernels._aot as aot; from nnkernels import Avgpool2dForward, Avgpool2dBackward\n"
            "good, bad = Avgpool2dForward.example(), Avgpool2dBackward.example()\n"
            "def refuse(target): raise ValueError('no PTX for this one')\n"
            "bad.build = refuse\n"
            "try:\n"
            "    aot.compile_in_subprocess([good, bad], 'sm_90', jobs=2)\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    done = _run_compiled(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"compiling {Avgpool2dBackward.example().id} for sm_90 failed:" in done.stdout
    assert "no PTX for this one" in done.stdout
