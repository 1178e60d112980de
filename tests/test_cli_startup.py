"""Starting fast: `import nnkernels` and the command's `--help` import neither torch nor Triton (nor the demo's
matplotlib and scikit-learn); every public name still resolves on first use; `--version`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nnkernels
from nnkernels.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_command_line_imports_neither_torch_nor_triton():
    assert python("import nnkernels.cli, sys; print('torch' in sys.modules, 'triton' in sys.modules)") == "False False"


def test_help_answers_without_torch():
    code = ("import sys; from nnkernels.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print('torch' in sys.modules)")
    out = python(code)
    assert "Commands:" in out and "tune" in out and out.endswith("False")


def test_the_mode_is_settled_first_and_the_kernels_import_no_extra():
    # An op file imports triton before nnkernels.kernel; nnkernels._mode must run before it all the same.
    out = python("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
                 "import sys; import nnkernels.ops.avg_pool2d.gather\n"
                 "import torch; from nnkernels import _mode\n"
                 "print(_mode.INTERPRETED == (not torch.cuda.is_available()))\n"
                 "import nnkernels.nn, nnkernels.functional, nnkernels.demo, nnkernels.tune_model\n"
                 "nnkernels.convert, nnkernels.catalogue()\n"
                 "print(sorted(m for m in ('matplotlib', 'sklearn', 'torchvision') if m in sys.modules))")
    assert out.splitlines() == ["True", "[]"]


def test_every_public_name_resolves():
    assert nnkernels.__all__ == sorted(nnkernels.__all__[:-1]) + ["__version__"]
    for name in nnkernels.__all__:
        assert getattr(nnkernels, name) is not None, name
    from nnkernels.ops.conv2d.seed import Conv2dBackward
    from nnkernels.step_warmup import warmup

    assert nnkernels.Conv2dBackward is Conv2dBackward and nnkernels.warmup is warmup
    assert nnkernels.nn.convert is nnkernels.convert
    assert nnkernels.tuning.cache_path  # submodules too, as when the package imported them eagerly
    with pytest.raises(AttributeError, match="no_such_name"):
        nnkernels.no_such_name  # noqa: B018


def test_every_module_imports():
    """Each module of the package, benchmarks included, imports (a stale import once broke `bench batch-norm`)."""
    import importlib
    import pkgutil

    names = [module.name for module in pkgutil.walk_packages(nnkernels.__path__, "nnkernels.")]
    assert "nnkernels.bench.batch_norm" in names and len(names) > 40
    for name in names:
        importlib.import_module(name)


def _installed():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version("nnkernels"))
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(not _installed(), reason="nnkernels runs from a source tree here, not installed: no metadata "
                                            "(test_version_without_metadata_falls_back covers that case)")
def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    assert nnkernels.__version__ == version("nnkernels")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"nnkernels {version('nnkernels')}\n"


def test_version_without_metadata_falls_back(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert nnkernels._version() == "0+unknown"
