"""The tuner: of a pass's candidate choices, time a few on the GPU and remember the fastest.

`choose(kind, key, candidates, run, decode)` returns one of the choices `candidates()` lists (frozen
dataclasses, the best guess first). It times them only when all of these hold: the process runs Triton
compiled (the interpreter takes the first guess, which there means few, large programs), tuning is not
switched off (`NNKERNELS_TUNE=off`), and the current CUDA stream is not capturing a graph (timing would break
the capture). Choices are remembered in memory and in `$NNKERNELS_CACHE_DIR/tuning.json` (default
`~/.cache/nnkernels/tuning.json`), keyed by the kind, the shape, the GPU, the Triton version and a hash of the
code of the kind's layer's kernels (`kernels_fingerprint`), so each shape is tuned once per machine and again
after one of those kernels changes. Where neither holds a choice, the table shipped with the package
(`nnkernels/tuned.json`, the same keys, made from tuning runs on the GPUs the project measures by
`tools/ship_tuning.py`) answers before any timing.

Cost bound: candidates are tried in order and no new one is started once TUNING_BUDGET_S have passed since
`choose` began on this kind and shape, unless it is the first of its family tried (`family`: its algorithm
where the choice names one, else its type): a first candidate that compiles for longer than the budget must
not win unopposed, since another algorithm may be many times faster. `NNKERNELS_TUNE=quick` (the default)
tries the first QUICK_CANDIDATES, `full` all of them. A process that compiles for another (`compile_for`, a
worker compiling ahead) runs, and so compiles, the choices the other's tuning would time, and times nothing.
What a choice means is its caller's: the tuner knows no op, only that a kind begins with its layer's name
(`kernels_fingerprint`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import pkgutil
import tempfile
import threading
import time
import tokenize
from dataclasses import asdict
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # Windows has none: there the last of two writers at once wins
    fcntl = None

import torch

from ._mode import INTERPRETED
from .machine import machine_of

TUNING_BUDGET_S = 2.0
# Above the H200's boost clock, so the GPU's sleep in `_time_ms` lasts at least as long as asked.
GPU_CYCLES_PER_S = 2.0e9
QUICK_CANDIDATES = 3
# Part of every stored key: a new layout of the stored choices never reads an older one.
CHOICES_FORMAT = "choices 2"
_log = logging.getLogger("nnkernels")
_lock = threading.Lock()
_memory: dict | None = None
# (kind, key, device index) -> the choice `choose` answered with, emptied whenever `_memory` is read in again.
_chosen: dict = {}
# In a process compiling for another: that process's tuning mode (`compile_for`).
_compiling_for: str | None = None


def mode() -> str:
    """`NNKERNELS_TUNE`: "off" (first guesses only), "quick" (default) or "full"."""
    value = os.environ.get("NNKERNELS_TUNE", "quick").lower()
    if value not in ("off", "quick", "full"):
        raise ValueError(f"NNKERNELS_TUNE: expected one of off, quick, full, got {value!r}")
    return value


def compile_for(tuning_mode: str):
    """From now on `choose` runs, without timing or remembering, each choice another process tuning in
    `tuning_mode` would run first (the remembered one, else the candidates that mode times) and answers the first
    guess: for processes that compile for another (their launches compile and run nothing, `kernel.compile_only`)."""
    global _compiling_for
    _compiling_for = tuning_mode


def _compile_choices(kind, key, listed, run, decode):
    """`choose` in a process compiling for another (`compile_for`)."""
    chosen = remembered(kind, key, listed, decode)
    count = {"off": 1, "full": len(listed)}.get(_compiling_for, QUICK_CANDIDATES)
    tried = [chosen] if chosen is not None else listed[:count]
    for choice in tried:
        try:
            run(choice)
        except Exception as error:
            if not _too_big(error):
                raise
    return tried[0]


def cache_path() -> Path:
    root = os.environ.get("NNKERNELS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nnkernels")
    return Path(root) / "tuning.json"


def _read(path: Path) -> dict:
    """The stored choices, or {} (with one warning) where the file is unreadable or not a JSON object."""
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        _log.warning("tuning: ignoring %s, which is not a readable tuning cache (%s)", path, error)
        return {}
    if not isinstance(stored, dict):
        _log.warning("tuning: ignoring %s, which holds no tuning choices", path)
        return {}
    return stored


SHIPPED_TABLE = Path(__file__).with_name("tuned.json")


@functools.cache
def _shipped() -> dict:
    """The choices shipped with the package (empty where there is no table or it cannot be read)."""
    return _read(SHIPPED_TABLE) if SHIPPED_TABLE.exists() else {}


def _stored() -> dict:
    global _memory
    if _memory is None:
        _memory = _read(cache_path())
        _chosen.clear()
    return _memory


@contextlib.contextmanager
def _file_locked(path: Path):
    """Held by one process at a time (an advisory lock on `path`; where the OS has none, nothing is held): the
    read, merge and write of the cache, so that two processes tuning at once keep both their choices."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _save(full_key: str, choice):
    """Merge one choice into the JSON file (re-read first: other processes may have added theirs), atomically,
    under the cache's file lock."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_locked(path.with_name(path.name + ".lock")):
            on_disk = _read(path)
            on_disk[full_key] = asdict(choice)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(on_disk, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as error:
        _log.warning("tuning: could not write %s (%s); the choice is kept for this process only", path, error)


@functools.cache
def kernels_fingerprint(kind: str) -> str:
    """12 hex digits of a hash over the code (`code_of`: helpers included, comments and docstrings not) of the
    kernels a choice of tuning `kind` is made among: a kind named after one of the layer packages of
    `nnkernels.ops` ("conv2d_dw": `ops/conv2d/`) hashes that package's kernels and the shared ones of
    `ops/common/`, so a change to one layer's kernels re-tunes that layer alone; any other kind, every one of the
    library's kernels. The seed kernels, which no choice launches, are left out."""
    from . import ops
    from .kernel import catalogue

    layers = [name for name in _layer_packages(ops) if kind.startswith(name)]
    prefixes = (f"nnkernels.ops.{max(layers, key=len)}.", "nnkernels.ops.common.") if layers else ("nnkernels.",)
    digest = hashlib.sha256()
    for cls in sorted(catalogue(), key=lambda cls: (cls.__module__, cls.__name__)):  # not import order
        if cls.__module__.startswith(prefixes) and not cls.seed:
            digest.update(code_of(cls._kernel_source).encode())
    return digest.hexdigest()[:12]


def code_of(source: str) -> str:
    """Python `source` as its code alone, one token after another: no comments, docstrings, blank lines, line
    breaks inside brackets or indentation widths, so that rewording a kernel's docstring or rewrapping its lines
    keeps its tuned choices (and the same on every Python from 3.10 on)."""
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skipped]
    kept, header, body = [], False, False  # in a `def` line; the statement next opens a function's body
    index = 0
    while index < len(tokens):
        token = tokens[index]
        starts_line = not kept or kept[-1][0] in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if (body and starts_line and token.type == tokenize.STRING and index + 1 < len(tokens)
                and tokens[index + 1].type == tokenize.NEWLINE):
            index, body = index + 2, False  # a docstring, and the end of its line
            continue
        if starts_line and token.type == tokenize.NAME and token.string == "def":
            header = True
        elif header and token.type == tokenize.NEWLINE:
            header, body = False, True
        elif token.type != tokenize.INDENT:
            body = False
        layout = token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        kept.append((token.type, tokenize.tok_name[token.type] if layout else token.string))
        index += 1
    return " ".join(text for _, text in kept)


def _layer_packages(ops) -> list[str]:
    return [module.name for module in pkgutil.iter_modules(ops.__path__) if module.ispkg and module.name != "common"]


def _full_key(kind: str, key) -> str:
    import triton

    device = machine_of(torch.device("cuda", torch.cuda.current_device())).name if torch.cuda.is_available() else "cpu"
    return f"{kind}|{key}|{device}|triton {triton.__version__}|kernels {kernels_fingerprint(kind)}|{CHOICES_FORMAT}"


def _time_ms(run, choice) -> float:
    """GPU ms of one `run(choice)`, the mean over enough back-to-back calls to fill about 10 ms.

    Most of these kernels take less GPU time than Python takes to launch them, so calls timed as they are
    enqueued would measure the launch overhead, the same for every choice. So the GPU first sleeps for longer
    than the calls take to enqueue; they then run back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    run(choice)
    torch.cuda.synchronize()
    one_call_s = time.perf_counter() - began  # enqueue + GPU time: bounds the enqueue time
    reps = max(1, min(50, int(0.010 / max(one_call_s, 1e-5))))
    torch.cuda._sleep(int(GPU_CYCLES_PER_S * 2 * one_call_s * reps))
    start.record()
    for _ in range(reps):
        run(choice)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _remembered(kind, key, decode):
    """The choice stored for `kind` and `key`, or None; an entry `decode` cannot read is dropped with a warning."""
    full_key = _full_key(kind, key)
    with _lock:
        stored = _stored().get(full_key)
    if stored is None:
        stored = _shipped().get(full_key)
    if stored is None:
        return None, full_key
    try:
        return decode(stored), full_key
    except (TypeError, ValueError, KeyError) as error:
        _log.warning("tuning: ignoring the stored choice for %s %s, which this version cannot read (%s)", kind, key,
                     error)
        with _lock:
            _stored().pop(full_key, None)
            _shipped().pop(full_key, None)
        return None, full_key


def _too_big(error) -> bool:
    """A choice the GPU cannot hold (shared memory, registers, or scratch memory) drops out of the timing."""
    return (isinstance(error, torch.cuda.OutOfMemoryError) or "OutOfResources" in type(error).__name__
            or "out of resource" in str(error))


def choose(kind: str, key, candidates: Callable[[], list], run, decode):
    """The choice to run `kind` with on shape `key` (see the module docstring).

    `candidates()` lists the choices, the best guess first; a remembered choice must be one of them (a cache edited
    by hand is not trusted). `run(choice)` must run the pass on the real tensors with `choice`; it is called only while tuning.
    `decode(stored)` turns a stored dict (`dataclasses.asdict` of a choice) back into the choice."""
    if INTERPRETED:
        return candidates()[0]
    if _compiling_for is not None:
        return _compile_choices(kind, key, candidates(), run, decode)
    if mode() == "off":
        return candidates()[0]
    chosen_key = (kind, key, torch.cuda.current_device() if torch.cuda.is_available() else -1)
    with _lock:
        _stored()  # reads the file in on first use, forgetting `_chosen`
        chosen = _chosen.get(chosen_key)
    if chosen is not None:
        return chosen
    chosen, full_key = _remembered(kind, key, decode)
    listed = candidates()
    if chosen is not None and chosen not in listed:  # an edited or foreign entry: never trusted
        _log.warning("tuning: ignoring the stored choice for %s %s, which is not one of its candidates", kind, key)
        chosen = None
    if chosen is not None:
        with _lock:
            _chosen[chosen_key] = chosen
        return chosen
    best_guess = listed[0]
    if len(listed) == 1 or torch.cuda.is_current_stream_capturing():
        return best_guess
    tried = listed if mode() == "full" else listed[:QUICK_CANDIDATES]
    began = time.perf_counter()
    timings = {}
    families = set()
    for choice in tried:
        if timings and time.perf_counter() - began > TUNING_BUDGET_S and family(choice) in families:
            continue
        families.add(family(choice))
        try:
            run(choice)  # compiles, and warms the caches
            timings[choice] = _time_ms(run, choice)
        except Exception as error:
            if not _too_big(error):
                raise
            _log.debug("tuning %s %s: %s does not fit (%s)", kind, key, choice, error)
    best = min(timings, key=timings.get) if timings else best_guess
    _log.debug("tuning %s %s: %s", kind, key, {str(c): round(t, 4) for c, t in timings.items()})
    with _lock:
        _stored()[full_key] = asdict(best)
        _chosen[chosen_key] = best
    _save(full_key, best)
    return best


def family(choice):
    """What a choice is a config of: its `algorithm` where it names one (a convolution's), else its type."""
    return getattr(choice, "algorithm", type(choice))


def peek(kind: str, key, candidates: list, decode):
    """The choice `choose` would use now, without timing anything: the remembered one or the first guess."""
    if INTERPRETED or len(candidates) == 1 or mode() == "off":
        return candidates[0]
    return remembered(kind, key, candidates, decode) or candidates[0]


def remembered(kind: str, key, candidates: list, decode):
    """The choice remembered for `kind` and `key` (this machine's cache, else the shipped table) where it is one of
    `candidates`, else None; whatever the tuning mode (a process that compiles for another asks this)."""
    if INTERPRETED:
        return None
    chosen, _ = _remembered(kind, key, decode)
    return chosen if chosen in candidates else None
