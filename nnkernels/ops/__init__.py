"""The kernels, one package per layer (`conv2d`, `avg_pool2d`, `batch_norm`) and `common` for what several
share. Importing this package imports every kernel module, which fills the catalogue."""
import importlib
import pkgutil

for _module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_module.name)
