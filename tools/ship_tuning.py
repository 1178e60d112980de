"""The table of tuned choices shipped with the package (`nnkernels/tuned.json`), from a tuning run's cache.

    PYTHONPATH=. python3 tools/ship_tuning.py CACHE.json [CACHE.json ...] [--into nnkernels/tuned.json]

Each CACHE is a `tuning.json` a GPU run wrote (e.g. `nnkernels bench models` with NNKERNELS_CACHE_DIR set).
Entries whose key names the current code of their layer's kernels (their fingerprint) and choice format are
merged into the table, later files winning; entries of older code are dropped, so a table only ever answers for
the kernels it was tuned on. Run where the package imports (no GPU needed).
"""
import argparse
import json
from pathlib import Path

from nnkernels import tuning


def current_entries(cache: dict) -> dict:
    """The entries whose key names the current sources of their op's kernels and the current choice format."""
    def current(key):
        return key.endswith(f"|kernels {tuning.kernels_fingerprint(key.split('|', 1)[0])}|{tuning.CHOICES_FORMAT}")

    return {key: value for key, value in cache.items() if current(key) and isinstance(value, dict)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", nargs="+", type=Path)
    parser.add_argument("--into", type=Path, default=tuning.SHIPPED_TABLE)
    args = parser.parse_args(argv)
    table = json.loads(args.into.read_text()) if args.into.exists() else {}
    table = current_entries(table)
    for cache in args.caches:
        table.update(current_entries(json.loads(cache.read_text())))
    args.into.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return f"{args.into}: {len(table)} choices"


if __name__ == "__main__":
    print(main())
