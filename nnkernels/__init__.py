"""nnkernels: GPU kernels for training convolutional networks, written in Triton.

Layers, top to bottom: `nnkernels.nn` (drop-in modules and `convert`), the functional ops
(`conv2d`, `conv_transpose2d`, `avg_pool2d`, `batch_norm`), the kernel objects (`catalogue()`), Triton.

Importing the package imports neither torch nor Triton: each public name is imported on first use, so
that the command line starts fast.
"""
import contextlib
import importlib
import sys

# Public name -> the submodule that defines it (None: the name is the submodule itself).
_NAMES = {
    "Avgpool2dBackward": "ops.avg_pool2d.seed",
    "Avgpool2dForward": "ops.avg_pool2d.seed",
    "BatchNorm2dNchwBackward": "ops.batch_norm.seed",
    "BatchNorm2dNchwForwardInference": "ops.batch_norm.seed",
    "CompiledKernel": "kernel",
    "Conv2dBackward": "ops.conv2d.seed",
    "Conv2dForward": "ops.conv2d.seed",
    "KernelObject": "kernel",
    "avg_pool2d": "functional",
    "batch_norm": "functional",
    "catalogue": "kernel",
    "compile_all": "kernel",
    "conv2d": "functional",
    "conv_transpose2d": "functional",
    "convert": "nn",
    "kernel_object": "kernel",
    "nn": None,
    "warmup": "step_warmup",
}

__all__ = sorted(_NAMES) + ["__version__"]

# Submodules that import neither Triton nor anything that does.
_LIGHT = {"nnkernels.cli", "nnkernels.__main__", "nnkernels._mode"}


class _ModeFirst:
    """Import `nnkernels._mode` before the first other submodule: Triton fixes interpreted vs compiled when it is
    imported, and most submodules import it (an op file before `nnkernels.kernel`, say)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("nnkernels.") and name not in _LIGHT:
            # Removed only once _mode has run, so that another thread's first import waits for it too.
            importlib.import_module("nnkernels._mode")
            with contextlib.suppress(ValueError):  # another thread may have removed it
                sys.meta_path.remove(self)
        return None  # the ordinary finders load `name` itself


if "nnkernels._mode" not in sys.modules:
    sys.meta_path.insert(0, _ModeFirst())


def _version() -> str:
    """The installed distribution's version; "0+unknown" where nnkernels runs from a source tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nnkernels")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name):
    if name == "__version__":
        value = _version()
    elif name in _NAMES:
        module = importlib.import_module(f".{_NAMES[name] or name}", __name__)
        value = module if _NAMES[name] is None else getattr(module, name)
    elif not name.startswith("__"):  # a submodule, as `nnkernels.tuning` was once `import nnkernels` imported it
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'nnkernels' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'nnkernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
