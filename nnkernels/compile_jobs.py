"""The layer jobs that background processes compile for this process, as its own first calls meet them.

`parallel_compile.Precompiling` registers itself here while its workers run. A layer call that builds its plan
first `claim`s its (shape, part) jobs: a job still queued leaves the queue (this process compiles it, and no worker
compiles it again later), and a job a worker holds is waited for (its kernels then come from Triton's cache),
so that the step never compiles the same kernels beside a worker. In a process without background compiles,
including the workers themselves, `claim` does nothing."""
from __future__ import annotations

import threading

_running: list = []  # the Precompiling objects whose workers run
_lock = threading.Lock()


def add(compiling):
    with _lock:
        _running.append(compiling)


def remove(compiling):
    with _lock:
        if compiling in _running:
            _running.remove(compiling)


def claim(*jobs):
    """Before this process builds the kernels of `jobs` ((layer shape, part) pairs, as `parallel_compile.job_order`
    names them) itself: take each from the background queues, or wait while a worker compiles it."""
    _each("claim", jobs)


def drop(*jobs):
    """`jobs` that this process's step will not run (a convolution's dx where its input takes no gradient): a queued
    one leaves the background queues, compiled by no one; one a worker holds is left to finish, not waited for."""
    _each("drop", jobs)


def _each(method: str, jobs):
    """`compiling.<method>(job)` for every job and every running `Precompiling`."""
    if not _running:
        return
    with _lock:
        running = list(_running)
    for compiling in running:
        for job in jobs:
            getattr(compiling, method)(job)
