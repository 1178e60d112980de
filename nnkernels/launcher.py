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

import functools
import inspect

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


def launch_hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton 3.6 holds None or the hook, later Tritons a `HookChain`
    whose `calls` are the hooks (empty, not None, when there are none)."""
    hook = knobs.runtime.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


@functools.lru_cache(maxsize=None)
def _known_launcher(launcher_type) -> bool:
    """Whether compiled kernels' launchers of this type are the one this module knows (Triton 3.6's: its call only
    adds scratch buffers, which callers of `_c_launch` do not need)."""
    params = list(inspect.signature(launcher_type.__call__).parameters)
    return params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


def _c_launch(run):
    """Triton's C launch function behind `run` (a compiled kernel's launcher) where `_known_launcher`, else None."""
    attrs = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    return run.launch if _known_launcher(type(run)) and all(hasattr(run, name) for name in attrs) else None


class Launcher:
    """Call with a kernel object's launch arguments, in its documented order."""

    __slots__ = ("kernel", "_go")

    def __init__(self, kernel):
        self.kernel = kernel
        self._go = None

    def __call__(self, *args):
        go = self._go
        if go is None or launch_hooked():
            return self._checked(args)
        go(*args)

    def _checked(self, args):
        grid, compiled = self.kernel.checked_launch(args)
        if self._go is not None or compiled is None or INTERPRETED:
            return
        self._go = _direct(compiled, tuple(grid) + (1,) * (3 - len(grid)),
                           next(value.device for value in args if hasattr(value, "device")).index,
                           self.kernel.constants_after_args)


def _direct(compiled, grid, device, constants):
    """A function that launches `compiled` over `grid` on the current stream of GPU `device`, its arguments then
    `constants`, as Triton's JIT launches a kernel it has found: straight into Triton's C launcher, with the global
    scratch a kernel needs (TMA descriptors made on the device) from torch's allocator; through the compiled
    kernel's launcher where its C launcher is not the one this module knows or it wants profiling scratch."""
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    stream = driver.active.get_current_stream
    grid_x, grid_y, grid_z = grid
    scratch_size = getattr(compiled.metadata, "global_scratch_size", 0)
    launch = _c_launch(run)
    if launch is not None and not run.profile_scratch_size:
        cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
        if not scratch_size:
            def go(*args):
                launch(grid_x, grid_y, grid_z, stream(device), function, cooperative, pdl, None, None, metadata,
                       None, None, None, *args, *constants)
            return go
        if compiled.metadata.global_scratch_align <= TORCH_ALIGNMENT:
            new_scratch = torch.empty(0, dtype=torch.int8, device=torch.device("cuda", device)).new_empty
            size = grid_x * grid_y * grid_z * getattr(run, "num_ctas", 1) * scratch_size

            def go_with_scratch(*args):
                # A fresh buffer per launch, as Triton's launcher takes one: a buffer kept across launches would,
                # if first made inside torch.compile's CUDA-graph trees, live in their pool, which they refuse.
                launch(grid_x, grid_y, grid_z, stream(device), function, cooperative, pdl, new_scratch(size), None,
                       metadata, None, None, None, *args, *constants)
            return go_with_scratch

    def go_through_launcher(*args):
        if scratch_size:
            use_torch_scratch()
        run(grid_x, grid_y, grid_z, stream(device), function, metadata, None, None, None, *args, *constants)
    return go_through_launcher


# The alignment of torch's CUDA allocations.
TORCH_ALIGNMENT = 256
