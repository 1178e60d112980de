"""`precompile_convs(shapes, dtype, jobs)`: compile, in `jobs` worker processes at once, every kernel that the first
calls of these convolutions may launch or time, so that the process which then runs them finds them in Triton's
disk cache instead of compiling them one after another.

A worker (`python -m nnkernels.parallel_compile`) takes one shape at a time from a queue the parent feeds and
runs `nnkernels.functional.conv.precompile` on fresh random tensors of it: per pass the choice tuning remembers
(the machine's cache or the shipped table) where there is one, else the candidates quick tuning would time, each
compiled and none run (`kernel.compile_only`; in the interpreter, where nothing compiles, run), nothing timed or
remembered. `start_precompile` does it in the background: `warmup` runs its step meanwhile and stops the
workers when the step is done. Workers are new interpreters started with `-m`, not
multiprocessing's spawned children, which would first re-run the user's script (its `__main__`); they share the
parent's environment, so its Triton cache and interpreter mode.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import astuple

import torch

from .conv_calls import ConvShape
from .kernel import compile_only


def _compile_conv(shape: ConvShape, dtype_name: str, tf32: bool, device: str):
    """In a worker: compile, without running them, the kernels of each choice `precompile` makes for `shape`."""
    from .functional.conv import precompile

    torch.backends.cudnn.allow_tf32 = tf32
    dtype = getattr(torch, dtype_name)
    x = torch.randn(shape.x_shape, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last) if shape.channels_last else x
    weight = torch.randn(shape.w_shape, device=device).to(dtype)
    # A channels-last output mostly means a model moved to channels_last, whose weights are channels-last too.
    weight = weight.contiguous(memory_format=torch.channels_last) if shape.channels_last else weight
    precompile(x, weight, shape.stride, shape.padding, shape.dilation, shape.groups, shape.bias)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Precompiling:
    """Workers compiling a list of convolution shapes in the background (`start_precompile`): `wait()` until they
    have done all (raising the first worker's error), or `stop()` them wherever they are."""

    def __init__(self, shapes, header, jobs):
        self.shapes, self._pending, self._children, self._stopped = shapes, queue.SimpleQueue(), [], False
        self._lock = threading.Lock()
        self.failures: list[str] = []
        for shape in shapes:
            self._pending.put(shape)
        self._threads = [threading.Thread(target=self._work, args=(header,), daemon=True)
                         for _ in range(max(1, min(jobs, len(shapes))))]
        for thread in self._threads:
            thread.start()

    def _work(self, header):
        with tempfile.TemporaryFile() as log:
            with self._lock:  # a worker started after `stop` would run to the end of its imports
                if self._stopped:
                    return
                child = subprocess.Popen([sys.executable, "-m", "nnkernels.parallel_compile"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log,
                                         env=dict(os.environ, NNKERNELS_TUNE="off"))
                self._children.append(child)
            try:
                pickle.dump(header, child.stdin)
                while not self.failures and not self._stopped:
                    try:
                        shape = self._pending.get_nowait()
                    except queue.Empty:
                        break
                    pickle.dump(astuple(shape), child.stdin)
                    child.stdin.flush()
                    try:
                        ok, error = pickle.load(child.stdout)
                    except EOFError:
                        log.seek(0)
                        ok, error = False, log.read().decode(errors="replace")[-4000:]
                    if not ok and not self._stopped:
                        self.failures.append(f"precompiling the convolution {shape.name} failed:\n{error}")
            except (BrokenPipeError, OSError):
                if not self._stopped:
                    raise
            finally:
                with contextlib.suppress(OSError):
                    child.stdin.close()
                child.wait()

    def finished(self) -> bool:
        """Whether every shape was answered (compiled, or failed: see `failures`) and the workers have ended."""
        return not self._stopped and all(not thread.is_alive() for thread in self._threads)

    def wait(self) -> int:
        """Block until every shape is compiled; their number. A worker's error is raised here, with the end of its
        output."""
        for thread in self._threads:
            thread.join()
        if self.failures:
            raise RuntimeError(self.failures[0])
        return len(self.shapes)

    def stop(self):
        """End the workers now (what they wrote to Triton's cache stays: it writes each entry whole)."""
        with self._lock:
            self._stopped = True
            for child in self._children:
                with contextlib.suppress(OSError):
                    child.kill()
        for thread in self._threads:
            thread.join()


def start_precompile(shapes, dtype: torch.dtype, jobs: int, device: str = "cuda") -> Precompiling:
    """Start compiling the kernels of each of `shapes` (ConvShapes) in `dtype` in `jobs` worker processes (each
    taking the next shape as it finishes one), under the current TF32 setting, in the background."""
    header = (str(dtype).replace("torch.", ""), torch.backends.cudnn.allow_tf32, device)
    return Precompiling(list(dict.fromkeys(shapes)), header, jobs)


def precompile_convs(shapes, dtype: torch.dtype, jobs: int, device: str = "cuda") -> int:
    """`start_precompile(...).wait()`: compile them all, then return how many shapes were done."""
    return start_precompile(shapes, dtype, jobs, device).wait()


def _serve():
    # Answers go to the original stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    dtype_name, tf32, device = pickle.load(requests)
    compile_only()
    while True:
        try:
            fields = pickle.load(requests)
        except EOFError:
            return
        try:
            _compile_conv(ConvShape(*fields), dtype_name, tf32, device)
            answer = (True, None)
        except Exception:  # the parent reports it, naming the shape
            answer = (False, traceback.format_exc()[-4000:])
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    _serve()
