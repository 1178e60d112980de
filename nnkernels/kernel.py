"""The kernel object: a `@triton.jit` function specialised on its compile-time constants.

`@kernel_object(...)` on a `@triton.jit` function makes a kernel class. Its parameters
become, in order:

- constants: parameters annotated `tl.constexpr`; the constructor takes them positionally
  or by their lower-case name, and the instance exposes them as lower-case attributes;
- launch arguments: every other parameter, in order. A name listed in `floats` is an fp32
  scalar; a name written in upper case (`B`, `C_IN`, `HW`) is an i32 size; any other name
  is a pointer to the element type chosen by the `dtype` keyword, unless `pointer_dtypes`
  fixes its type (statistics kept in fp32, say).

The kernel-specific launcher, `entry(kernel, args) -> grid`, checks the sizes against the
tensors and returns the grid; `launch()` runs the generic checks (count, types, dtypes,
devices, contiguity), then `entry`, then the Triton function, compiled on CUDA tensors
and through Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
import textwrap
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ._mode import INTERPRETED

import triton  # noqa: E402  (after _mode)
from triton import knobs  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INT32_MAX = 2**31 - 1
# Compute capabilities Triton's NVIDIA backend builds for and bf16 runs on.
COMPILE_TARGETS = (80, 86, 87, 89, 90, 100, 120)

_CATALOGUE: "OrderedDict[str, type]" = OrderedDict()
_FIRST_LAUNCH = threading.RLock()
# (kernel hash, device index, specialization) of every kernel that has run once -> the compiled kernel
# its later launches run directly (None where this Triton's compiled kernel does not offer that).
_LAUNCHED: dict = {}
# Set in processes that only fill Triton's disk cache for another (`parallel_compile`'s workers): a first launch
# compiles its kernel and runs nothing, so they leave the GPU to the process that times and trains.
_COMPILE_ONLY = False


def compile_only():
    """From now on, this process's compiled launches compile their kernels and run nothing (their outputs stay
    unwritten). For processes that compile for another; there is no way back."""
    global _COMPILE_ONLY
    _COMPILE_ONLY = True


def _on_device(device: torch.device):
    """The context a launch on `device` runs in: Triton launches on the current GPU, so switch to `device`
    unless it is current already (or a CPU): a `torch.cuda.device` context costs several times as much as
    asking which device is current (docs/notes.md, "Host time")."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _specialization(arg_checks, args) -> tuple:
    """What Triton specialises a compiled kernel on, of these launch arguments (`arg_checks`: a kernel object's
    (name, int / float / dtype) per argument): each pointer's 16-byte alignment, each i32's divisibility by 16
    and equality to 1 (dtypes are fixed by the kernel object, and every i32 is in [1, 2**31 - 1])."""
    return tuple((value % 16 == 0, value == 1) if expected is int else value.data_ptr() % 16 == 0
                 for (_, expected), value in zip(arg_checks, args) if expected is not float)


def _can_run_directly(compiled) -> bool:
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata", "launch_metadata"))


def _run_compiled(compiled, grid, device_index, full_args):
    """Launch a kernel Triton compiled for these arguments' specialization, as `JITFunction.run` launches it
    once it has found the kernel in its cache (the same call in Triton 3.6 and 3.9). That search (binding
    the arguments, specialising them, hashing the key, checking the kernel's globals) is what this skips, a
    third of a launch's host time through Triton's JIT (docs/notes.md, "Host time")."""
    stream = driver.active.get_current_stream(device_index)
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *full_args), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *full_args)


@dataclass(frozen=True)
class CompiledKernel:
    """What `KernelObject.compile(target)` returns: the PTX, the cubin and their metadata."""

    name: str
    target: str
    ptx: str
    cubin: bytes
    shared: int
    num_warps: int
    signature: "OrderedDict[str, str]"
    constants: dict


def catalogue() -> list[type]:
    """Every kernel class, in the order the library defines them."""
    from . import ops  # noqa: F401  (importing ops registers every kernel class)

    return list(_CATALOGUE.values())


def compile_all(kernels, target: str = "sm_90") -> list[CompiledKernel]:
    """`[k.compile(target) for k in kernels]`, with one compiler process for all when interpreted."""
    parse_target(target)
    if INTERPRETED:
        from ._aot import compile_in_subprocess

        pending = [k for k in kernels if target not in k._compiled]
        for kernel, built in zip(pending, compile_in_subprocess(pending, target) if pending else []):
            kernel._compiled[target] = built
    return [k.compile(target) for k in kernels]


def parse_target(target: str) -> int:
    """`"sm_90"` -> 90; anything Triton cannot build for is a ValueError naming `target`."""
    match = re.fullmatch(r"sm_(\d+)a?", str(target))
    if match is None or int(match.group(1)) not in COMPILE_TARGETS:
        known = ", ".join(f"sm_{c}" for c in COMPILE_TARGETS)
        raise ValueError(f"target: expected one of {known}, got {target!r}")
    return int(match.group(1))


def _body_source(fn) -> str:
    """The function's source from its `def` line on (decorators dropped)."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return "\n".join(lines[start:]) + "\n"


class KernelObject:
    """Base of every kernel class; see the module docstring. Subclasses come from `kernel_object`."""

    # Filled in per class by `kernel_object`.
    name: str
    constant_names: tuple
    arg_names: tuple
    seed: bool
    example_constants: tuple

    def __init__(self, *constants, dtype=torch.float32, num_warps=None, num_stages=None, **named):
        cls = type(self)
        if dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype: expected one of torch.float32, torch.float16, torch.bfloat16, got {dtype}")
        values = self._bind_constants(constants, named)
        for cname, value in values.items():
            cls._check_constant(cname, value)
        for option, value in (("num_warps", num_warps), ("num_stages", num_stages)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{option}: expected a positive int, got {value!r}")
        self.dtype = dtype
        self.constants = values
        self.num_warps = num_warps or cls._default_num_warps
        self.num_stages = num_stages or cls._default_num_stages
        for cname, value in values.items():
            setattr(self, cname.lower(), value)
        type_name = DTYPE_NAMES[dtype]
        parts = [cls.name, type_name] + [str(int(v)) for v in values.values()]
        if (num_warps, num_stages) != (None, None):
            parts += [f"w{self.num_warps}", f"s{self.num_stages}"]
        self.id = "__".join(parts)
        self.kernel_source = cls._kernel_source
        self.entry_point_source = cls._entry_point_source
        self.source = self.kernel_source + "\n\n" + self.entry_point_source
        self.entry_point_name = f"{cls.name}_entry_point"
        self.signature = OrderedDict(
            (arg, cls._arg_types[arg] if cls._arg_types[arg] != "*D" else f"*{type_name}") for arg in cls.arg_names
        )
        key = f"{self.source}|{self.id}|{sorted(values.items())}|{self.num_warps}|{self.num_stages}"
        self.hash = hashlib.sha256(key.encode()).hexdigest()
        self._compiled: dict[str, CompiledKernel] = {}
        # A kernel's launch arguments come before its constants (`kernel_object` checks), so the Triton function's
        # full argument list is a launch's arguments, then these.
        self.constants_after_args = tuple(values[name] for name in cls.constant_names)
        # (argument, what it must be: int for an i32, float for an fp32, else a tensor's dtype), made once so that
        # a launch's checks look nothing up
        self._arg_checks = tuple((arg, int if kind == "i32" else float if kind == "fp32" else _TORCH_DTYPES[kind[1:]])
                                 for arg, kind in self.signature.items())

    def _bind_constants(self, positional, named) -> dict:
        cls = type(self)
        names = [c.lower() for c in cls.constant_names]
        if len(positional) > len(names):
            raise TypeError(f"{cls.__name__} takes {len(names)} constants ({', '.join(names)}), got {len(positional)}")
        values = dict(zip(names, positional))
        for key, value in named.items():
            if key not in names:
                raise TypeError(f"{cls.__name__}: unknown constant {key!r}; constants are {', '.join(names)}")
            if key in values:
                raise TypeError(f"{cls.__name__}: constant {key!r} given twice")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{cls.__name__}: missing constant(s) {', '.join(missing)}")
        return OrderedDict((c, values[c.lower()]) for c in cls.constant_names)

    @classmethod
    def _check_constant(cls, cname, value):
        label = cname.lower()
        if cname in cls._flags:
            if not isinstance(value, bool):
                raise TypeError(f"{label}: expected a bool, got {value!r}")
            return
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{label}: expected an int, got {value!r}")
        lowest = 0 if cname in cls._nonnegative else 1
        if value < lowest:
            raise ValueError(f"{label}: expected an int >= {lowest}, got {value}")
        if cname.startswith("BLOCK") and value & (value - 1):
            raise ValueError(f"{label}: expected a power of two, got {value}")

    @classmethod
    def example(cls, dtype=torch.float32):
        """The representative instance the catalogue compiles (see `kernel_object`'s `example`)."""
        return cls(*cls.example_constants, dtype=dtype)

    def __repr__(self):
        consts = ", ".join(f"{k.lower()}={v}" for k, v in self.constants.items())
        return f"{type(self).__name__}({consts}, dtype={self.dtype})"

    def launch(self, *args):
        """Check `args` (the documented launch arguments, in order), compute the grid and run."""
        self.checked_launch(args)

    def checked_launch(self, args) -> tuple:
        """`launch`'s work: (the grid, Triton's compiled kernel that ran, or None where the launch went through
        Triton's JIT or interpreter). A plan's `Launcher` launches that compiled kernel directly afterwards."""
        cls = type(self)
        if len(args) != len(cls.arg_names):
            raise TypeError(
                f"{cls.__name__}.launch takes {len(cls.arg_names)} arguments "
                f"({', '.join(cls.arg_names)}), got {len(args)}"
            )
        named = SimpleNamespace(**dict(zip(cls.arg_names, args)))
        device = None
        has_floats = False
        for (arg, expected), value in zip(self._arg_checks, args):
            if expected is int:
                if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
                    raise TypeError(f"{arg}: expected an int, got {type(value).__name__}")
                if not 1 <= value <= INT32_MAX:
                    raise ValueError(f"{arg}: expected an int in [1, 2**31 - 1], got {value}")
            elif expected is float:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(f"{arg}: expected a float, got {type(value).__name__}")
                has_floats = True
            else:
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{arg}: expected a torch.Tensor of {expected}, got {type(value).__name__}")
                if value.dtype != expected:
                    raise TypeError(f"{arg}: expected dtype {expected}, got {value.dtype}")
                if device is None:
                    device = value.device
                elif value.device != device:
                    raise ValueError(f"{arg}: expected a tensor on {device} like {cls.arg_names[0]}, got "
                                     f"{value.device}")
                if not value.is_contiguous():
                    raise ValueError(f"{arg}: expected a contiguous tensor, got strides {tuple(value.stride())}")
        if device.type == "cpu" and not INTERPRETED:
            raise ValueError(
                f"{cls.arg_names[0]}: CPU tensors need Triton's interpreter, but this process runs Triton "
                "compiled; set TRITON_INTERPRET=1 before importing nnkernels, or pass CUDA tensors"
            )
        grid = cls._entry(self, named)
        if has_floats:  # an int given for an fp32 argument would make Triton compile for an int
            args = tuple(float(value) if expected is float else value
                          for (_, expected), value in zip(self._arg_checks, args))
        with _on_device(device):
            if INTERPRETED:
                # The interpreter patches Triton's language for the whole process while it runs, so
                # interpreted launches go one at a time.
                with _FIRST_LAUNCH:
                    cls._runner[grid](*args, **self.constants, num_warps=self.num_warps, num_stages=self.num_stages)
                return grid, None
            if _COMPILE_ONLY:
                with _FIRST_LAUNCH:
                    cls._runner.warmup(*args, grid=grid, **self.constants, num_warps=self.num_warps,
                                       num_stages=self.num_stages)
                return grid, None
            first = (self.hash, device.index, _specialization(self._arg_checks, args))
            if first in _LAUNCHED:
                compiled = _LAUNCHED[first]
                if compiled is None:
                    cls._runner[grid](*args, **self.constants, num_warps=self.num_warps, num_stages=self.num_stages)
                else:
                    _run_compiled(compiled, grid, device.index, self._full_args(args))
                return grid, compiled
            # A kernel's first compiled launch compiles it: one thread does, the others wait and reuse it.
            with _FIRST_LAUNCH:
                compiled = cls._runner[grid](*args, **self.constants, num_warps=self.num_warps,
                                             num_stages=self.num_stages)
                _LAUNCHED[first] = compiled if _can_run_directly(compiled) else None
                return grid, _LAUNCHED[first]

    def _full_args(self, args) -> tuple:
        """The Triton function's arguments in its parameter order: `args`, then the constants."""
        return (*args, *self.constants_after_args)

    def compile(self, target: str = "sm_90") -> CompiledKernel:
        """Compile ahead of time for `target` (e.g. "sm_90") with Triton's compiler; needs no GPU.

        The build assumes nothing of the arguments' values, so it runs on any valid launch. `launch`
        goes through Triton's JIT instead, which specialises on 16-byte aligned pointers and on integer
        arguments divisible by 16: on aligned tensors its loads can be vectors where this PTX has
        one element per instruction."""
        parse_target(target)
        if target not in self._compiled:
            if INTERPRETED:
                from ._aot import compile_in_subprocess

                self._compiled[target] = compile_in_subprocess([self], target)[0]
            else:
                self._compiled[target] = self.build(target)
        return self._compiled[target]

    def triton_compile(self, target: str, aligned: bool = False, sizes: dict | None = None):
        """Triton's compiled kernel for `target` (its `asm` holds every stage, TTGIR to cubin), built in this
        process. `aligned`: specialised as `launch`'s JIT specialises aligned tensors (pointers 16-byte
        aligned, every integer argument a multiple of 16, or, where `sizes` ({name: value}) gives its value,
        as that value is) instead of assuming nothing (see `compile`)."""
        cls = type(self)
        signature = dict(self.signature)
        signature.update({c: "constexpr" for c in cls.constant_names})
        params = list(inspect.signature(cls._compile_fn.fn).parameters)
        sizes = sizes or {}
        attrs = {(params.index(name),): [["tt.divisibility", 16]] for name, kind in self.signature.items()
                 if aligned and (kind.startswith("*") or (kind.startswith("i") and sizes.get(name, 16) % 16 == 0))}
        source = ASTSource(cls._compile_fn, signature, _constexpr_keys(cls._compile_fn, self.constants), attrs)
        return triton.compile(
            source,
            target=GPUTarget("cuda", parse_target(target), 32),
            options={"num_warps": self.num_warps, "num_stages": self.num_stages},
        )

    def build(self, target: str) -> CompiledKernel:
        """Run Triton's compiler in this process; see `compile`, which also serves interpreted processes."""
        built = self.triton_compile(target)
        return CompiledKernel(
            name=built.name,
            target=target,
            ptx=built.asm["ptx"],
            cubin=built.asm["cubin"],
            shared=int(built.metadata.shared),
            num_warps=int(built.metadata.num_warps),
            signature=OrderedDict(self.signature),
            constants=dict((k.lower(), v) for k, v in self.constants.items()),
        )


_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _constexpr_keys(fn, constants: dict) -> dict:
    """ASTSource's constexpr mapping: by name in newer Triton, by (index,) in older releases."""
    params = list(inspect.signature(fn.fn).parameters)
    return {(params.index(k),): v for k, v in constants.items()}


def kernel_object(
    jitted,
    *,
    entry,
    example: tuple,
    floats: tuple = (),
    pointer_dtypes: dict | None = None,
    nonnegative: tuple = (),
    flags: tuple = (),
    num_warps: int = 4,
    num_stages: int = 3,
    seed: bool = False,
    helpers: tuple = (),
):
    """Make a kernel class from a `@triton.jit` function (see module docstring); its name is the
    function's in CamelCase (`conv2d_backward` -> `Conv2dBackward`).

    `entry(kernel, args) -> grid` is the kernel's launcher: it checks the sizes in `args` (a
    namespace of the launch arguments by name) against the tensors and returns the grid.
    `example` holds the constants of a representative instance: what `nnkernels compile`
    builds when it is asked for the whole catalogue. `helpers` are the `@triton.jit` functions the
    kernel calls: their sources join the kernel's, and so its content hash.
    """

    fn = getattr(jitted, "fn", jitted)
    class_name = "".join(part.capitalize() for part in fn.__name__.split("_"))
    params = inspect.signature(fn).parameters
    constant_names = tuple(n for n, p in params.items() if "constexpr" in str(p.annotation))
    arg_names = tuple(n for n in params if n not in constant_names)
    if tuple(params)[:len(arg_names)] != arg_names:
        raise ValueError(f"jitted: {fn.__name__}'s launch arguments must all come before its tl.constexpr constants")
    arg_types = OrderedDict()
    for arg in arg_names:
        if arg in floats:
            arg_types[arg] = "fp32"
        elif arg.isupper():
            arg_types[arg] = "i32"
        elif pointer_dtypes and arg in pointer_dtypes:
            arg_types[arg] = "*" + DTYPE_NAMES[pointer_dtypes[arg]]
        else:
            arg_types[arg] = "*D"
    entry_point_name = f"{fn.__name__}_entry_point"
    symbol = lambda _: entry_point_name  # noqa: E731  (Triton names the PTX entry after this)
    attrs = dict(
        name=fn.__name__,
        constant_names=constant_names,
        arg_names=arg_names,
        seed=seed,
        example_constants=tuple(example),
        __doc__=fn.__doc__,
        __module__=fn.__module__,
        _arg_types=arg_types,
        _entry=staticmethod(entry),
        _flags=frozenset(flags),
        _nonnegative=frozenset(nonnegative),
        _default_num_warps=num_warps,
        _default_num_stages=num_stages,
        _runner=triton.jit(repr=symbol)(fn),
        _compile_fn=JITFunction(fn, repr=symbol),
        _kernel_source="\n\n".join(_body_source(getattr(f, "fn", f)) for f in (fn, *helpers)),
        _entry_point_source="\n\n".join(_body_source(f) for f in (entry, KernelObject.launch,
                                                                    KernelObject.checked_launch, _specialization,
                                                                    _run_compiled)),
    )
    cls = type(class_name, (KernelObject,), attrs)
    if class_name in _CATALOGUE:
        raise ValueError(f"jitted: a kernel class named {class_name!r} already exists")
    _CATALOGUE[class_name] = cls
    return cls
