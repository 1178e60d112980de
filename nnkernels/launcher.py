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

from triton import knobs
from triton.runtime import driver

from ._mode import INTERPRETED


class Launcher:
    """Call with a kernel object's launch arguments, in its documented order."""

    __slots__ = ("kernel", "_run", "_grid", "_function", "_metadata", "_device", "_constants", "_stream")

    def __init__(self, kernel):
        self.kernel = kernel
        self._run = None

    def __call__(self, *args):
        run = self._run
        if run is None or knobs.runtime.launch_enter_hook is not None:
            return self._checked(args)
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
        self._run = compiled.run
