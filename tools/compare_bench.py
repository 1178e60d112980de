"""Two runs of a benchmark suite side by side: each row's time and speed-up over PyTorch before and after.

    PYTHONPATH=. python3 tools/compare_bench.py BEFORE.csv AFTER.csv [--noise 0.05]

BEFORE and AFTER are the CSVs `nnkernels bench` writes (any suite: rows keyed by case, dtype and direction).
"speed" is our time before over after (above 1: faster now); the speed-ups over PyTorch, timed in the same run,
are what compares across GPU machines of different speed, but they move with PyTorch's own choices too
(`cudnn.benchmark` picks again in every process). Rows where either moved by more than `--noise` are listed,
slowest first, then the geometric means over the rows both runs hold, and the rows only one of them holds.
"""
import argparse
import csv
import math
from pathlib import Path


def timings(path: Path) -> dict:
    """{(case, dtype, direction): (our ms, speed-up)} of the rows of one bench CSV (the suite's totals too)."""
    with open(path, newline="") as f:
        return {(row["case"], row["dtype"], row["direction"]): (float(row["ours_ms"]), float(row["speedup"]))
                for row in csv.DictReader(f)}


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def compare(before: dict, after: dict, noise: float) -> str:
    """The markdown report of `main`."""
    shared = [key for key in before if key in after]
    speed = {key: before[key][0] / after[key][0] for key in shared}
    moved_x = {key: after[key][1] / before[key][1] for key in shared}
    limit = math.log1p(noise)
    moved = sorted((key for key in shared if max(abs(math.log(speed[key])), abs(math.log(moved_x[key]))) > limit),
                   key=speed.get)
    lines = ["| case | dtype | pass | ours before ms | ours after ms | speed | x before | x after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in moved:
        case, dtype, direction = key
        lines.append(f"| {case} | {dtype} | {direction} | {before[key][0]:.4f} | {after[key][0]:.4f} | "
                     f"{speed[key]:.2f} | {before[key][1]:.2f}x | {after[key][1]:.2f}x |")
    lines.append("")
    lines.append(f"{len(shared)} rows in both runs, {len(moved)} moved by more than {noise:.0%}; geometric means: "
                 f"speed {_geomean(speed.values()):.3f}, speed-up over PyTorch {_geomean(moved_x.values()):.3f}")
    for name, rows, other in (("before", before, after), ("after", after, before)):
        alone = [key for key in rows if key not in other]
        if alone:
            lines.append(f"only {name}: " + "; ".join(" ".join(key) for key in alone))
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--noise", type=float, default=0.05, help="relative change listed as a move (0.05)")
    args = parser.parse_args(argv)
    if not args.noise > 0:
        parser.error(f"--noise: expected a fraction > 0, got {args.noise}")
    report = compare(timings(args.before), timings(args.after), args.noise)
    print(report)
    return report


if __name__ == "__main__":
    main()
