"""The `nnkernels` command: every subcommand's help, output files and exit codes (0 ok, 2 bad
usage, 1 failure with one line), and a cubin from `compile` launched through the CUDA driver API."""
import ctypes
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import INTERPRETED, assert_close, gpu, poisoned, randn

from nnkernels.cli import main

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_KEYS = {"id", "hash", "entry_point_name", "signature", "constants", "target", "shared", "num_warps"}


def nnkernels(capsys, *args):
    """Run the command in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_python_dash_m_runs_the_command():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "nnkernels", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    for command in ("demo", "tune", "compile", "list", "bench"):
        assert command in done.stdout


@pytest.mark.parametrize("command", ["demo", "tune", "compile", "list", "bench"])
def test_every_subcommand_has_help(capsys, command):
    code, out, _ = nnkernels(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"Usage: nnkernels {command}")


@pytest.mark.parametrize("command", ["tune", "compile"])
def test_jobs_help_names_the_cap_the_code_applies(capsys, command):
    from nnkernels._aot import MOST_JOBS

    code, out, _ = nnkernels(capsys, command, "--help")
    assert code == 0
    assert f"one per CPU, at most {MOST_JOBS}" in " ".join(out.split())


@pytest.mark.parametrize("args, where", [
    (["frobnicate"], "No such command"),
    (["compile", "--target", "sm_75"], "--target"),
    (["compile", "--target", "sm_90", "NoSuchKernel"], "NoSuchKernel"),
    (["compile", "--dtype", "fp64"], "--dtype"),
    (["bench", "no_such_op"], "no_such_op"),
    (["demo", "--epochs", "0"], "--epochs"),
    (["demo", "--device", "tpu"], "--device"),
    (["list", "--bogus"], "--bogus"),
    (["tune"], "MODEL"),
    (["tune", "no_such_module_here:model"], "no_such_module_here"),
    (["tune", "--dtype", "fp64", "m:f"], "--dtype"),
    (["compile", "--jobs", "0"], "--jobs"),
])
def test_bad_usage_exits_2_naming_the_problem(capsys, args, where):
    code, out, err = nnkernels(capsys, *args)
    assert code == 2
    assert where in err and "Usage:" in err
    assert out == ""


@pytest.mark.skipif(not INTERPRETED, reason="the no-GPU refusal needs a machine without one")
def test_demo_on_cuda_without_a_gpu_is_bad_usage(capsys):
    code, _, err = nnkernels(capsys, "demo", "--device", "cuda")
    assert code == 2 and "--device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_without_a_gpu_in_one_line(capsys, tmp_path):
    code, out, err = nnkernels(capsys, "bench", "--out", str(tmp_path), "conv2d")
    assert code == 1
    assert err.strip().count("\n") == 0 and "need a CUDA GPU" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())
    code, _, err = nnkernels(capsys, "--debug", "bench", "conv2d")
    assert code == 1 and "Traceback" in err
    for spelling in ("avg_pool2d", "avg-pool2d"):  # both spellings name the suite; only the GPU is missing
        code, _, err = nnkernels(capsys, "bench", "--out", str(tmp_path), spelling)
        assert code == 1 and "need a CUDA GPU" in err


def test_bench_names_an_unknown_suite(capsys, tmp_path):
    code, _, err = nnkernels(capsys, "bench", "--out", str(tmp_path), "max_pool2d")
    assert code == 2 and "unknown suite(s) max_pool2d" in err and "avg-pool2d" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_list_shows_every_kernel_with_its_signature_and_user(capsys):
    from nnkernels.kernel import catalogue

    code, out, _ = nnkernels(capsys, "list")
    assert code == 0
    for cls in catalogue():
        assert cls.__name__ in out
    # tests/test_cli_list.py reads every row's signature back out of the wrapped cells
    assert "conv2d" in out and "avg_pool2d" in out and "batch_norm" in out


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_compile_writes_ptx_cubin_and_manifest(capsys, tmp_path, target):
    code, out, err = nnkernels(capsys, "compile", "--target", target, "--out", str(tmp_path),
                               "--dtype", "bf16", "Avgpool2dForward", "conv2d_backward")
    assert code == 0, out
    assert "compiling 2 kernel(s)" in err
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["target"] == target
    assert [k["kernel"] for k in manifest["kernels"]] == ["Avgpool2dForward", "Conv2dBackward"]
    for entry in manifest["kernels"]:
        assert MANIFEST_KEYS <= entry.keys()
        assert entry["target"] == target and entry["num_warps"] >= 1 and entry["shared"] >= 0
        assert "__bf16__" in entry["id"] and len(entry["hash"]) == 64
        ptx = (tmp_path / f"{entry['id']}.ptx").read_text()
        assert f".entry {entry['entry_point_name']}(" in ptx
        assert f".target sm_{target[3:]}" in ptx
        assert (tmp_path / f"{entry['id']}.cubin").read_bytes()[:4] == b"\x7fELF"
    assert manifest["kernels"][1]["signature"]["dy"] == "*bf16"
    assert manifest["kernels"][1]["constants"]["kh"] == 3


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python before 12.6
    return driver


def _check(result):
    error = result[0]
    assert int(error) == 0, f"CUDA driver error {error}"
    return result[1] if len(result) > 1 else None


@gpu
def test_compiled_cubin_launched_with_the_driver_api_matches_launch(capsys, tmp_path):
    """`compile` output, loaded with cuModuleLoadData and run with cuLaunchKernel, computes what
    `Avgpool2dForward.launch` computes on the same input."""
    pytest.importorskip("cuda.bindings")
    from nnkernels import Avgpool2dForward

    code, _, _ = nnkernels(capsys, "compile", "--target", "sm_90", "--out", str(tmp_path), "Avgpool2dForward")
    assert code == 0
    entry = json.loads((tmp_path / "manifest.json").read_text())["kernels"][0]
    kernel = Avgpool2dForward.example()  # kh=kw=2, stride 2, block_ow=64, fp32: the manifest's instance
    assert kernel.id == entry["id"]
    B, C, H, W = 2, 3, 10, 12
    OH, OW = (H - 2) // 2 + 1, (W - 2) // 2 + 1
    x = randn(B, C, H, W)
    expected = poisoned(B, C, OH, OW)
    kernel.launch(x, expected, B, C, H, W, OH, OW)
    y = poisoned(B, C, OH, OW)
    torch.cuda.synchronize()

    driver = _driver()
    _check(driver.cuInit(0))
    module = _check(driver.cuModuleLoadData((tmp_path / f"{entry['id']}.cubin").read_bytes()))
    function = _check(driver.cuModuleGetFunction(module, entry["entry_point_name"].encode()))
    ptx = (tmp_path / f"{entry['id']}.ptx").read_text()
    parameters = ptx[ptx.index(f".entry {entry['entry_point_name']}("):].split(")")[0]
    num_params = len(re.findall(rf"{entry['entry_point_name']}_param_\d+", parameters))
    values = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr())]
    values += [ctypes.c_int32(v) for v in (B, C, H, W, OH, OW)]
    # Triton appends its scratch-buffer pointers after the kernel's own arguments; this kernel uses none.
    values += [ctypes.c_void_p(0) for _ in range(num_params - len(values))]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    grid = B * C * OH * math.ceil(OW / kernel.block_ow)
    _check(driver.cuLaunchKernel(function, grid, 1, 1, 32 * entry["num_warps"], 1, 1, entry["shared"],
                                 0, ctypes.addressof(params), 0))
    _check(driver.cuCtxSynchronize())
    assert torch.equal(y, expected)
    assert_close(y, torch.nn.functional.avg_pool2d(x.double(), 2))
    _check(driver.cuModuleUnload(module))
