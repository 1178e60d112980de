"""One module per kernel family; importing this package imports them all, which registers
every kernel class in the catalogue."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
