"""Ahead-of-time compilation in child processes, one kernel after another or several at once.

An interpreted process cannot also run Triton's compiler: the interpreter patches Triton's
language functions for the whole process. So such a process compiles in child processes
that run Triton compiled (they need no GPU), and gets the PTX and cubin back. The same
children compile in parallel for any process: Triton's compiler keeps global state (its
knobs, its caches, the patched language) and holds the GIL through its Python passes, so
one compiler per process is what it allows, and processes are what run several at once.

A compiled (not interpreted) process that may fork forks its children: they start with torch,
Triton and the kernels already imported, where a new interpreter spends some 1.6 s of CPU
importing them again. Otherwise a child (`python -m nnkernels._aot TARGET`) reads pickled
kernel specs from stdin one at a time and answers each with a pickled `CompiledKernel` (or an
error) on stdout.
"""
import concurrent.futures
import importlib
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import traceback


def _spec(kernel) -> tuple:
    return (type(kernel).__module__, type(kernel).__name__, tuple(kernel.constants.values()), str(kernel.dtype),
            kernel.num_warps, kernel.num_stages)


# Each child holds torch and Triton (some hundreds of MB). On a 16-CPU machine a cold first step was faster with
# 11 of them than with 8 (docs/notes.md, "The first step").
MOST_JOBS = 16


def default_jobs(count: int) -> int:
    """Child processes for `count` kernels: one per CPU this process may use, at most MOST_JOBS, and no more than
    there are kernels."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MOST_JOBS, count))


def compile_in_subprocess(kernels, target, jobs=1, on_done=None):
    """Compile each kernel object of `kernels` for `target` in `jobs` child processes, each taking the next
    kernel as it finishes one; the results in the order of `kernels`. `on_done(kernel)` is called (from this
    thread or a worker thread) as each is built."""
    kernels = list(kernels)
    if not kernels:
        return []
    if _can_fork():
        return _compile_in_forks(kernels, target, jobs, on_done)
    results = [None] * len(kernels)
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for index in range(len(kernels)):
        pending.put(index)
    failures = []

    def work():
        with tempfile.TemporaryFile() as log:
            child = subprocess.Popen([sys.executable, "-m", "nnkernels._aot", target], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=dict(os.environ, TRITON_INTERPRET="0"))
            try:
                while not failures:
                    try:
                        index = pending.get_nowait()
                    except queue.Empty:
                        break
                    pickle.dump(_spec(kernels[index]), child.stdin)
                    child.stdin.flush()
                    try:
                        ok, built = pickle.load(child.stdout)
                    except EOFError:
                        log.seek(0)
                        stderr = log.read().decode(errors="replace")[-4000:]
                        failures.append(f"compiling {kernels[index].id} for {target} failed:\n{stderr}")
                        break
                    if not ok:
                        failures.append(f"compiling {kernels[index].id} for {target} failed:\n{built}")
                        break
                    results[index] = built
                    if on_done is not None:
                        on_done(kernels[index])
            finally:
                child.stdin.close()
                child.wait()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(jobs, len(kernels))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(failures[0])
    return results


def _can_fork() -> bool:
    """Whether children forked from this process can run Triton's compiler: it runs Triton compiled, the
    platform forks, and CUDA is not initialised (a forked child cannot use the parent's context)."""
    from ._mode import INTERPRETED

    if INTERPRETED or "fork" not in multiprocessing.get_all_start_methods():
        return False
    import torch

    return not torch.cuda.is_initialized()


_forked_kernels: list = []  # the kernels a forked child compiles, set before the fork


def _build_forked(index: int, target: str):
    return _forked_kernels[index].build(target)


def _hash_triton_once():
    """Triton keys its cache by a hash of its own sources (some 0.3 s, remembered per process): taken here, before
    the fork, the children inherit it instead of each taking it again."""
    for module_name in ("triton.runtime.cache", "triton.compiler.compiler"):  # where Triton 3.9 / older keep it
        triton_key = getattr(importlib.import_module(module_name), "triton_key", None)
        if triton_key is not None:
            triton_key()
            return


def _compile_in_forks(kernels, target, jobs, on_done):
    """`compile_in_subprocess` in `jobs` forked children, which inherit `kernels`; an error names the kernel."""
    _forked_kernels[:] = kernels
    _hash_triton_once()
    results = [None] * len(kernels)
    workers = max(1, min(jobs, len(kernels)))
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            # Longest first (by source length) so that no long compile is left to run alone at the end.
            order = sorted(range(len(kernels)), key=lambda i: -len(type(kernels[i])._kernel_source))
            futures = {pool.submit(_build_forked, index, target): index for index in order}
            for future in concurrent.futures.as_completed(futures):
                index = futures[future]
                try:
                    results[index] = future.result()
                except Exception as error:  # the parent reports it, naming the kernel
                    for other in futures:
                        other.cancel()
                    detail = "".join(traceback.format_exception(error))[-4000:]
                    raise RuntimeError(f"compiling {kernels[index].id} for {target} failed:\n{detail}") from None
                if on_done is not None:
                    on_done(kernels[index])
    finally:
        _forked_kernels.clear()
    return results


def _serve(target):
    # The answers go to the original stdout; anything the compiler prints goes to stderr instead.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch

    requests = sys.stdin.buffer
    while True:
        try:
            module, class_name, constants, dtype, num_warps, num_stages = pickle.load(requests)
        except EOFError:
            return
        try:
            cls = getattr(importlib.import_module(module), class_name)
            kernel = cls(*constants, dtype=getattr(torch, dtype.split(".")[-1]), num_warps=num_warps,
                         num_stages=num_stages)
            answer = (True, kernel.build(target))
        except Exception:  # the parent reports it, naming the kernel
            answer = (False, traceback.format_exc()[-4000:])
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
