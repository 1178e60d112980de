"""`nnkernels list` fits the terminal: at 80 columns no line is longer, and every kernel is still there."""
import os
import re
import subprocess
import sys
from pathlib import Path

from nnkernels.cli import signature_runs
from nnkernels.kernel import catalogue

ROOT = Path(__file__).resolve().parents[1]


def cells(text: str) -> list[list[str]]:
    """The rows of the printed table, each a list of its cells' text (wrapped lines joined by spaces)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "kernel (used by)" in line)
    starts = [lines[header].index(title) for title in ("kernel (used by)", "constants (example)", "launch signature")]
    bounds = list(zip(starts, starts[1:] + [None]))
    rows, block = [], []
    for line in lines[header + 2:] + [""]:
        if line.strip():
            block.append(line)
        elif block:
            rows.append([" ".join(part[a:b].strip() for part in block).strip() for a, b in bounds])
            block = []
    return rows


def test_list_fits_80_columns():
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80")
    done = subprocess.run([sys.executable, "-m", "nnkernels", "list"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    rows = cells(done.stdout)
    squeeze = lambda text: re.sub(r"\s+", "", text)  # noqa: E731  (cells wrap at spaces, or inside long words)
    assert len(rows) == len(catalogue())
    for cls, (kernel, constants, signature) in zip(catalogue(), rows):
        assert squeeze(kernel).startswith(cls.__name__)
        assert squeeze(signature) == squeeze(signature_runs(cls._arg_types))
        assert squeeze(constants).startswith(f"{cls.constant_names[0].lower()}=")


def test_signature_runs_keep_the_order_and_group_by_type():
    from nnkernels import BatchNorm2dNchwBackward, Conv2dBackward

    assert signature_runs(Conv2dBackward._arg_types) == "dy, x, w, dx, dw: *dtype; B, C_IN, C_OUT, H, W, OH, OW: i32"
    assert signature_runs(BatchNorm2dNchwBackward._arg_types).endswith("B, C, HW: i32; eps: fp32")
