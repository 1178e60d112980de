"""`precompile_layers(shapes, dtype, jobs)`: compile, in `jobs` worker processes at once, every kernel that the first
calls of these layers (convolutions, batch norms, average poolings) may launch or time, so that the process which
then runs them finds them in Triton's disk cache instead of compiling them one after another.

A worker (`python -m nnkernels.parallel_compile`) takes one job at a time, a shape's forward or its backward (a
convolution's dw or dx), from a queue the parent feeds (the forwards in the step's order, then the backwards in
reverse: `Precompiling`) and compiles its kernels, none run (`kernel.compile_only`; in the interpreter, where
nothing compiles, run), nothing timed or remembered: for a convolution `nnkernels.functional.conv.precompile` of
those passes on fresh random tensors of it (per pass the choice tuning remembers, the machine's cache or the shipped
table, where there is one, else the candidates quick tuning would time); for a batch norm or a pooling, the
functional op's forward (and backward) on such tensors, where tuning runs the choices the parent's tuning would time
(`tuning.compile_for`). `start_precompile` does it in the background: `warmup` runs its step meanwhile and stops the
workers when the step is done, and the step's first calls claim the jobs they reach (`compile_jobs`: a queued one
leaves the queue, one a worker holds is waited for). Workers are new interpreters started with `-m`, not
multiprocessing's spawned children, which would first re-run the user's script (its `__main__`); they share the
parent's environment, so its Triton cache and interpreter mode.
"""
from __future__ import annotations

import collections
import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
import torch

from . import compile_jobs, tuning
from .kernel import compile_only
from .layer_calls import AvgPoolShape, BatchNormShape, ConvShape

WORKER_RESTARTS = 2
CLAIM_WAIT_S = 300.0  # the longest this process waits on a worker's job before compiling it too (a hung worker)


def _input(shape, dtype, device):
    """A random x of `shape`'s size and layout."""
    x = torch.randn(shape.x_shape, device=device).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if shape.channels_last else x


def _compile_conv(shape: ConvShape, part: str, dtype: torch.dtype, device: str):
    """In a worker: compile, without running them, the kernels of each choice `precompile` makes for `part` of
    `shape`."""
    from .functional.conv import precompile

    x = _input(shape, dtype, device)
    weight = torch.randn(shape.w_shape, device=device).to(dtype)
    # A channels-last output mostly means a model moved to channels_last, whose weights are channels-last too.
    weight = weight.contiguous(memory_format=torch.channels_last) if shape.channels_last else weight
    precompile(x, weight, shape.stride, shape.padding, shape.dilation, shape.groups, shape.bias,
               forward=part == "forward", backward=part != "forward",
               backward_passes=() if part == "forward" else (part,))


def _compile_batch_norm(shape: BatchNormShape, part: str, dtype: torch.dtype, device: str):
    """In a worker: one forward (and for the backward `part`, its backward) of batch norm as the layer calls it, on
    random tensors."""
    from .functional.batchnorm import batch_norm

    x = _input(shape, dtype, device).requires_grad_()
    channels = shape.x_shape[1]
    weight = torch.ones(channels, device=device, requires_grad=True)
    bias = torch.zeros(channels, device=device, requires_grad=True)
    running = (torch.zeros(channels, device=device), torch.ones(channels, device=device)) if (
        shape.running or not shape.training) else (None, None)
    y = batch_norm(x, *running, weight, bias, training=shape.training, momentum=0.1, eps=1e-5)
    if part == "backward":
        y.backward(torch.randn_like(y))


def _compile_avg_pool(shape: AvgPoolShape, part: str, dtype: torch.dtype, device: str):
    """In a worker: one forward (and for the backward `part`, its backward) of average pooling as the layer calls
    it, on random tensors."""
    from .functional.pooling import avg_pool2d

    x = _input(shape, dtype, device).requires_grad_()
    y = avg_pool2d(x, shape.kernel, shape.stride, shape.padding, shape.ceil_mode, shape.count_include_pad,
                   shape.divisor or None)
    if part == "backward":
        y.backward(torch.randn_like(y))


_COMPILERS = {ConvShape: _compile_conv, BatchNormShape: _compile_batch_norm, AvgPoolShape: _compile_avg_pool}


def _compile(shape, part: str, dtype_name: str, tf32: bool, device: str):
    torch.backends.cudnn.allow_tf32 = tf32
    _COMPILERS[type(shape)](shape, part, getattr(torch, dtype_name), device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def backward_parts(shape) -> tuple:
    """The jobs of a layer call's backward: a convolution's dw and dx apart, so that two workers build them at
    once (a depthwise layer's dw alone can take 20 s); one "backward" job for the other layers."""
    return ("dw", "dx") if isinstance(shape, ConvShape) else ("backward",)


def job_order(shapes) -> list:
    """The (shape, part) jobs of `shapes` (in a step's order) as workers take them: every forward in that order,
    then every backward in reverse, as the step reaches them, so that workers run ahead of the step, not behind."""
    return [(shape, "forward") for shape in shapes] + [(shape, part) for shape in reversed(shapes)
                                                       for part in backward_parts(shape)]


class Precompiling:
    """Workers compiling a list of layer shapes in the background (`start_precompile`): `wait()` until they
    have done all (raising the first worker's error), or `stop()` them wherever they are. Each shape's jobs, its
    forward's kernels and its backward's (`backward_parts`), are taken in `job_order`, but for those this process
    `claim`s first."""

    def __init__(self, shapes, header, jobs):
        self.shapes, self._children, self._stopped = shapes, [], False
        self.jobs = job_order(shapes)  # every job, in the order the workers take them
        self._pending = collections.deque(self.jobs)
        self._held: set = set()  # the jobs a worker is compiling now
        self._lock = threading.Lock()
        self._answers = threading.Condition()  # guards _pending and _held; notified as each job is answered
        self.failures: list[str] = []
        self.compiled: list = []  # the (shape, part) jobs answered without error
        self.claimed: list = []  # the jobs this process took from the queue to compile itself (`claim`)
        self.dropped: list = []  # the jobs this process said it will not need, taken from the queue (`drop`)
        self._threads = [threading.Thread(target=self._work, args=(header,), daemon=True)
                         for _ in range(max(1, min(jobs, len(self._pending))))]
        compile_jobs.add(self)
        for thread in self._threads:
            thread.start()

    def _work(self, header):
        """Feed jobs to worker processes until none are left; a worker that dies is replaced (the job it held counts
        as failed), at most WORKER_RESTARTS times a thread, so that one crash leaves the rest compiled."""
        for _ in range(1 + WORKER_RESTARTS):
            if not self._serve(header):
                return

    def _take(self):
        """The next queued job, now held by the calling thread's worker; None when none is left."""
        with self._answers:
            if self._stopped or not self._pending:
                return None
            job = self._pending.popleft()
            self._held.add(job)
            return job

    def claim(self, job, timeout: float = CLAIM_WAIT_S):
        """Where this process is about to build `job` itself: a queued job leaves the queue (no worker compiles it),
        and a job a worker holds is waited for until answered, the workers stopped or `timeout` seconds passed (then
        this process compiles it as well). Any other job: nothing."""
        with self._answers:
            if job in self._pending:
                self._pending.remove(job)
                self.claimed.append(job)
                return
            self._answers.wait_for(lambda: job not in self._held or self._stopped, timeout)

    def drop(self, job):
        """Where this process will not need `job`: a queued job leaves the queue, compiled by no one; a job a worker
        holds is not waited for."""
        with self._answers:
            if job in self._pending:
                self._pending.remove(job)
                self.dropped.append(job)

    def _serve(self, header) -> bool:
        """One worker process's life: whether it died before the jobs ran out."""
        with tempfile.TemporaryFile() as log:
            with self._lock:  # a worker started after `stop` would run to the end of its imports
                if self._stopped:
                    return False
                # faulthandler: a worker killed by a fault leaves its traceback in the failure
                child = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "nnkernels.parallel_compile"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=dict(os.environ, NNKERNELS_TUNE="off"))
                self._children.append(child)
            job = None
            try:
                pickle.dump(header, child.stdin)
                while True:
                    job = self._take()
                    if job is None:
                        return False
                    pickle.dump(job, child.stdin)
                    child.stdin.flush()
                    ok, error = pickle.load(child.stdout)
                    self._answered(job, ok, error, error.strip().splitlines()[-1] if error else None)
                return False
            except (EOFError, BrokenPipeError, OSError):
                if self._stopped:
                    return False
                child.wait()
                log.seek(0)
                self._answered(job, False, log.read().decode(errors="replace")[-4000:],
                               f"its process ended with exit status {child.returncode}")
                return True
            finally:
                with contextlib.suppress(OSError):
                    child.stdin.close()
                child.wait()

    def _answered(self, job, ok, error, reason=None):
        """Count a job's answer; a failure's first line says why (`reason`), the rest is its worker's output."""
        if ok:
            self.compiled.append(job)
        elif job is not None and not self._stopped:
            shape, part = job
            what = "the convolution " if isinstance(shape, ConvShape) else ""
            self.failures.append(f"precompiling the {part} of {what}{shape.name} failed ({reason}):\n{error}")
        with self._answers:
            self._held.discard(job)
            self._answers.notify_all()

    def finished(self) -> bool:
        """Whether every job was answered (compiled, or failed: see `failures`) and the workers have ended."""
        return not self._stopped and all(not thread.is_alive() for thread in self._threads)

    def wait(self) -> int:
        """Block until every job is answered; the number of shapes. The first failure is raised here, with the end of
        its worker's output."""
        for thread in self._threads:
            thread.join()
        compile_jobs.remove(self)
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
        with self._answers:  # a claim waiting on a killed worker's job returns: this process compiles it
            self._answers.notify_all()
        compile_jobs.remove(self)
        for thread in self._threads:
            thread.join()


def start_precompile(shapes, dtype: torch.dtype, jobs: int, device: str = "cuda") -> Precompiling:
    """Start compiling the kernels of each of `shapes` (`layer_calls` shapes) in `dtype` in `jobs` worker processes
    (each taking the next job as it finishes one: `job_order`), under the current TF32 setting and tuning mode, in
    the background."""
    header = (str(dtype).replace("torch.", ""), torch.backends.cudnn.allow_tf32, device, tuning.mode())
    return Precompiling(list(dict.fromkeys(shapes)), header, jobs)


def precompile_layers(shapes, dtype: torch.dtype, jobs: int, device: str = "cuda") -> int:
    """`start_precompile(...).wait()`: compile them all, then return how many shapes were done."""
    return start_precompile(shapes, dtype, jobs, device).wait()


def _serve():
    # Answers go to the original stdout; anything a library prints goes to stderr instead.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    dtype_name, tf32, device, tuning_mode = pickle.load(requests)
    compile_only()
    tuning.compile_for(tuning_mode)
    while True:
        try:
            shape, part = pickle.load(requests)
        except EOFError:
            return
        try:
            _compile(shape, part, dtype_name, tf32, device)
            answer = (True, None)
        except Exception:  # the parent reports it, naming the shape
            answer = (False, traceback.format_exc()[-4000:])
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    _serve()
