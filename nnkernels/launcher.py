"""`Launcher(kernel)`: one launch of a kernel object inside a plan, which makes it with the same sizes every time.

The first call goes through `KernelObject.checked_launch` (every argument check, the grid, Triton's compilation)
and keeps the grid and the compiled kernel. Every later call hands its arguments to Triton's compiled
launcher directly, as Triton's own JIT does once it has found a compiled kernel: no checks, no grid, no search.
That is sound because a plan is built per signature (shapes, strides, dtypes, device, flags), with every
tensor it receives 16-byte aligned, as Triton's specialisation on the first call assumed: the checks the first
call made hold for every later one.

In the interpreter, and while a launch hook is set (a profiler's), every call takes `launch`'s checked path.
"""
from __future__ import annotations

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver

from ._mode import INTERPRETED


def _torch_scratch(size: int, alignment: int, stream):
    # torch's allocations are 256-byte aligned and ordered on the current stream, as the launch is.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_torch_scratch():
    """Let Triton take a kernel's global scratch (TMA descriptors made on the device) from torch's caching
    allocator, unless this thread's context has set an allocator of its own. Triton keeps the allocator per
    context, and autograd runs backward passes on threads of its own, so every launch that needs scratch asks."""
    current = getattr(_allocation, "_allocator", None)  # private: if Triton moves it, ours is set
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


class Launcher:
    """Call with a kernel object's launch arguments, in its documented order."""

    __slots__ = ("kernel", "_run", "_grid", "_function", "_metadata", "_device", "_constants", "_stream", "_scratch")

    def __init__(self, kernel):
        self.kernel = kernel
        self._run = None

    def __call__(self, *args):
        run = self._run
        if run is None or knobs.runtime.launch_enter_hook is not None:
            return self._checked(args)
        if self._scratch:
            use_torch_scratch()
        grid = self._grid
        run(grid[0], grid[1], grid[2], self._stream(self._device), self._function, self._metadata, None, None, None,
            *args, *self._constants)

    def _checked(self, args):
        grid, compiled = self.kernel.checked_launch(args)
        if compiled is None or INTERPRETED:
            return
        device = next(value.device for value in args if hasattr(value, "device"))
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._device = device.index
        self._constants = self.kernel.constants_after_args
        self._stream = driver.active.get_current_stream
        self._scratch = getattr(compiled.metadata, "global_scratch_size", 0) > 0
        self._run = compiled.run
