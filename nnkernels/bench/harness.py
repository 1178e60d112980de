"""Timing and reporting shared by the benchmark suites.

Times are medians of `triton.testing.do_bench` over CUDA-graph replays (so Python launch
overhead is out of both sides), after warm-up, with nnkernels and PyTorch measured in the
same process, one after the other, on the same inputs.
"""
from __future__ import annotations

import collections
import csv
import datetime
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    """One measured case: nnkernels and PyTorch on the same shape, dtype and pass."""

    suite: str
    case: str
    dtype: str
    direction: str  # "forward" or "backward"
    ours_ms: float
    torch_ms: float
    work: float  # flops (compute-bound ops) or bytes (memory-bound ops) the pass must do/move
    unit: str  # "TFLOP/s" or "TB/s"
    extra: dict = field(default_factory=dict)  # further columns, e.g. the seed kernel's time

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.ours_ms

    def rate(self, ms: float) -> float:
        return self.work / (ms * 1e-3) / 1e12


def require_gpu():
    """Benchmarks mean GPU times; refuse clearly where there is no CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks need a CUDA GPU, and this machine has none")


def time_ms(fn, *, graph: bool = True) -> float:
    """Median milliseconds of one call of `fn` on the current CUDA stream.

    With `graph`, `fn` is captured once in a CUDA graph and the graph's replays are timed.
    """
    import triton.testing

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        run = cuda_graph.replay
    else:
        run = fn
    return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")


# The H200's copy ceiling for large tensors (shared/ANCHORS.md): bytes read + written per second.
COPY_TBPS = 4.27


def copy_ms(nbytes: int) -> float:
    """Median ms of the faster of PyTorch's two device copies moving `nbytes` (half read, half
    written), timed as `time_ms` times everything else: the copy ceiling for a pass of that size,
    measured in the same run. A small pass cannot reach COPY_TBPS (a 19 MB copy is mostly launch and
    ramp-up), so the memory-bound benches judge each pass against the copy of its own byte count, and
    print both. The two copies: the device-to-device memcpy that `copy_` issues, and PyTorch's
    vectorized elementwise kernel (a negation): neither is the faster at every size."""
    source = torch.zeros(nbytes // 8, dtype=torch.float32, device="cuda")
    destination = torch.empty_like(source)
    return min(time_ms(lambda: destination.copy_(source)), time_ms(lambda: torch.neg(source, out=destination)))


def bandwidth_columns(nbytes: int, ours_ms: float) -> dict:
    """The memory-bound benches' extra columns: the floor at COPY_TBPS and our share of it, the same-size
    copy's time and our share of its bandwidth (copy time over ours)."""
    floor_ms, same_size_copy_ms = nbytes / (COPY_TBPS * 1e12) * 1e3, copy_ms(nbytes)
    return dict(floor_ms=f"{floor_ms:.4f}", of_peak=f"{100 * floor_ms / ours_ms:.0f}%",
                copy_ms=f"{same_size_copy_ms:.4f}", of_copy=f"{100 * same_size_copy_ms / ours_ms:.0f}%")


def kernel_times(step, steps: int = 5, name_length: int = 90) -> collections.Counter:
    """{kernel name (cut to `name_length`): mean µs of GPU time per call of `step`}, from
    torch.profiler over `steps` calls after three warm-up calls: where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:name_length]] += event.device_time / steps
    return totals


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def environment() -> str:
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{datetime.date.today()} | {gpu} | torch {torch.__version__} | triton {triton.__version__}"


def write_csv(rows: list[Row], path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        extra_keys = sorted({k for r in rows for k in r.extra})
        writer = csv.writer(f)
        writer.writerow(["suite", "case", "dtype", "direction", "ours_ms", "torch_ms", "speedup", "unit",
                         "ours_rate", "torch_rate", *extra_keys])
        for r in rows:
            d = asdict(r)
            writer.writerow([r.suite, r.case, r.dtype, r.direction, f"{r.ours_ms:.4f}", f"{r.torch_ms:.4f}",
                             f"{r.speedup:.3f}", r.unit, f"{r.rate(r.ours_ms):.2f}", f"{r.rate(r.torch_ms):.2f}",
                             *[d["extra"].get(k, "") for k in extra_keys]])


def plot(rows: list[Row], path: Path, title: str):
    """A bar chart of the speed-up over PyTorch per case (log scale; 1x marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.case} {r.dtype} {r.direction[:3]}" for r in rows]
    speedups = [r.speedup for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    colours = ["tab:green" if s >= 1 else "tab:red" for s in speedups]
    ax.barh(range(len(rows)), speedups, color=colours)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up over PyTorch (x, log scale)")
    ax.set_title(f"{title}\n{environment()}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[Row], title: str) -> str:
    """The rows as fixed-width text: both times, the ratio and both rates."""
    lines = [title, environment(),
             f"{'case':34} {'dtype':9} {'pass':8} {'ours ms':>9} {'torch ms':>9} {'speedup':>8} {'ours':>8} {'torch':>8} unit"]
    for r in rows:
        lines.append(f"{r.case:34} {r.dtype:9} {r.direction:8} {r.ours_ms:9.4f} {r.torch_ms:9.4f} "
                     f"{r.speedup:7.2f}x {r.rate(r.ours_ms):8.2f} {r.rate(r.torch_ms):8.2f} {r.unit}"
                     + "".join(f" {k}={v}" for k, v in r.extra.items()))
    lines.append(f"geometric mean speed-up: {geomean(r.speedup for r in rows):.3f}x over {len(rows)} rows")
    return "\n".join(lines)


def report(rows: list[Row], out: Path, suite: str, title: str) -> str:
    """Write `<suite>.csv` and `<suite>.png` into `out`; return the table under `title`."""
    write_csv(rows, out / f"{suite}.csv")
    plot(rows, out / f"{suite}.png", title)
    return table(rows, title)
