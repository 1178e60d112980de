"""Every tuned launch of a benchmark suite with each candidate's GPU time: what tuning chose
among, and whether quick tuning (the first three candidates) would have found the best.

    PYTHONPATH=. python3 tools/tuning_table.py SUITE --out DIR [the suite's own options]

SUITE is a module of nnkernels.bench (conv2d, avg_pool2d, batch_norm). The suite runs with
NNKERNELS_TUNE=full and a fresh tuning cache (unless the environment sets them), so every
candidate is timed; the tuner's DEBUG log is kept as DIR/tuning.log and printed as a table
after the suite's own: per pass and shape, candidate i's algorithm (for convolutions) and config fields
(block_m, block_n, block_k, num_warps, num_stages, split, ... in their order) and its time, the best marked
with '*'. Needs a GPU.
"""
import importlib
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

LAUNCH = re.compile(r"^tuning (\S+) (.*): \{(.*)\}$")
# A choice as the tuner logs it: a config's repr, or a convolution's Choice(algorithm='...', config=...).
CANDIDATE = re.compile(r"[\"'](?:Choice\(algorithm='(\w+)', config=)?\w+Config\(([^)]*)\)\)?[\"']: ([\d.]+)")


def table(log_text: str) -> str:
    """The tuner's DEBUG lines ("tuning KIND KEY: {'<choice>': ms, ...}") as a table."""
    lines = []
    for line in log_text.splitlines():
        launch = LAUNCH.match(line)
        timings = [(algorithm, fields, float(ms)) for algorithm, fields, ms in CANDIDATE.findall(launch[3])] if (
            launch) else []
        if not timings:
            continue
        best = min(ms for _, _, ms in timings)
        lines.append(f"{launch[1]} {launch[2]}")
        for index, (algorithm, fields, ms) in enumerate(timings):
            values = ",".join(field.split("=")[1] for field in fields.split(", "))
            label = f"{algorithm} {values}" if algorithm else values
            lines.append(f"  {'*' if ms == best else ' '}{index} {label:28} {1000 * ms:9.1f} us")
    return "\n".join(lines)


def main():
    suite, options = sys.argv[1], sys.argv[2:]
    out = Path(options[options.index("--out") + 1]) if "--out" in options else Path("bench-out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NNKERNELS_TUNE", "full")
    os.environ.setdefault("NNKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="nnkernels-tuning-"))
    log = out / "tuning.log"
    logging.basicConfig(level=logging.WARNING, filename=log, filemode="w", format="%(message)s")
    logging.getLogger("nnkernels").setLevel(logging.DEBUG)
    bench = importlib.import_module(f"nnkernels.bench.{suite}")
    sys.argv = [f"nnkernels.bench.{suite}"] + options
    bench.main()
    print(table(log.read_text()))


if __name__ == "__main__":  # the conv2d suite compiles in spawned workers, which import this file
    main()
