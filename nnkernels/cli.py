"""The `nnkernels` command: demo, compile, list, bench.

Exit codes: 0 success, 2 bad usage (click's own usage errors), 1 failure. A failure prints
one line, `nnkernels: error: ...`; `nnkernels --debug ...` prints the traceback instead.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import traceback
from pathlib import Path

import click

DTYPES = ("fp32", "fp16", "bf16")

_state = {"debug": False}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="On failure, print the full traceback instead of one line.")
def cli(debug):
    """nnkernels: GPU kernels for training convolutional networks, written in Triton.

    Without a GPU, the kernels run on the CPU through Triton's interpreter.
    """
    _state["debug"] = debug


@cli.command()
# The defaults are nnkernels.demo's DEFAULT_EPOCHS and DEFAULT_BATCH_SIZE, written out so that
# `--help` need not import the kernels (tests/test_demo.py checks they agree).
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Passes over the training set.")
@click.option("--batch-size", type=click.IntRange(min=2), default=128, show_default=True,
              help="Images per training step.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: the GPU when there is one, else the CPU through Triton's interpreter.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the initial weights and batch order.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"),
              show_default=True, help="Folder for loss_curves.png and summary.json.")
@click.option("--limit", type=click.IntRange(min=2), default=None,
              help="Train on the first LIMIT training images only (a quick check; accuracy suffers).")
def demo(epochs, batch_size, device, seed, out, limit):
    """Train a small CNN on scikit-learn's digits with nnkernels beside its torch.nn twin.

    Both start from the same weights and see the same batches; every convolution, batch
    norm and pooling of the nnkernels network, forward and backward, runs nnkernels'
    kernels. Prints both test accuracies, the largest loss difference and the kernels that
    ran; saves the loss curves (PNG) and a JSON summary.
    """
    from . import demo as demo_module

    demo_module.check_device(device)
    demo_module.run(epochs=epochs, batch_size=batch_size, device=device, seed=seed, out=out, limit=limit)


def _resolve_kernels(names):
    """Catalogue classes by class name (Conv2dForward) or function name (conv2d_forward); all if none."""
    from .kernel import catalogue

    classes = catalogue()
    if not names:
        return classes
    by_name = {}
    for cls in classes:
        by_name[cls.__name__.lower()] = cls
        by_name[cls.name.lower()] = cls
    unknown = [n for n in names if n.lower() not in by_name]
    if unknown:
        known = ", ".join(cls.__name__ for cls in classes)
        raise click.BadParameter(f"unknown kernel(s) {', '.join(unknown)}; the catalogue holds {known}",
                                 param_hint="KERNEL")
    return list(dict.fromkeys(by_name[n.lower()] for n in names))


@cli.command("compile")
@click.option("--target", default="sm_90", show_default=True, help="GPU architecture, e.g. sm_80, sm_90.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder  [default: build/<target>]")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Element type(s) to build each kernel for (repeatable)  [default: fp32]")
@click.argument("kernels", nargs=-1, metavar="[KERNEL]...")
def compile_command(target, out, dtypes, kernels):
    """Compile the catalogue (or the named KERNELs) ahead of time; needs no GPU.

    Writes <id>.ptx and <id>.cubin for each kernel's example instance, and manifest.json:
    id, hash, entry-point name, signature, constants, target, shared memory, num_warps.
    """
    import torch

    from .kernel import compile_all, parse_target

    try:
        parse_target(target)
    except ValueError as err:
        raise click.BadParameter(str(err).split(": ", 1)[1], param_hint="--target") from None
    classes = _resolve_kernels(kernels)
    dtype_of = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    instances = [cls.example(dtype_of[d]) for cls in classes for d in (dtypes or ("fp32",))]
    out = out or Path("build") / target
    click.echo(f"compiling {len(instances)} kernel(s) for {target} ...", err=True)
    built = compile_all(instances, target)
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for kernel, compiled in zip(instances, built):
        (out / f"{kernel.id}.ptx").write_text(compiled.ptx)
        (out / f"{kernel.id}.cubin").write_bytes(compiled.cubin)
        manifest.append({
            "id": kernel.id,
            "kernel": type(kernel).__name__,
            "hash": kernel.hash,
            "entry_point_name": compiled.name,
            "signature": dict(compiled.signature),
            "constants": compiled.constants,
            "dtype": str(kernel.dtype).replace("torch.", ""),
            "target": compiled.target,
            "shared": compiled.shared,
            "num_warps": compiled.num_warps,
            "ptx": f"{kernel.id}.ptx",
            "cubin": f"{kernel.id}.cubin",
        })
    (out / "manifest.json").write_text(json.dumps({"target": target, "kernels": manifest}, indent=2) + "\n")
    click.echo(f"wrote {len(manifest)} PTX + cubin pairs and manifest.json to {out}")


def kernel_users() -> dict:
    """Kernel class -> the functional ops that launch it (each op's entry in `nnkernels.functional.common.KERNELS`)."""
    from .functional.common import KERNELS

    users: dict = {}
    for op, classes in KERNELS.items():
        for cls in classes:
            users.setdefault(cls, []).append(op)
    return users


@cli.command("list")
def list_command():
    """Show the kernel catalogue: kernel, constants, launch signature and the functional op using it."""
    from rich.console import Console
    from rich.table import Table

    from .kernel import catalogue

    users = kernel_users()
    table = Table(title="nnkernels catalogue", show_lines=True)
    for column in ("kernel", "constants (example)", "launch signature", "used by"):
        table.add_column(column, overflow="fold")
    for cls in catalogue():
        constants = ", ".join(f"{c.lower()}={v}" for c, v in zip(cls.constant_names, cls.example_constants))
        signature = ", ".join(f"{a}: {t.replace('*D', '*dtype')}" for a, t in cls._arg_types.items())
        used_by = ", ".join(users.get(cls, [])) or ("seed (spec)" if cls.seed else "-")
        table.add_row(cls.__name__, constants, signature, used_by)
    Console(width=max(Console().width, 140)).print(table)


def bench_suites() -> tuple:
    """Every suite `bench` runs, by the name it takes on the command line (a module of nnkernels.bench with run(),
    its underscores written as hyphens): the harness's SUITES first."""
    from . import bench

    extra = [m.name for m in pkgutil.iter_modules(bench.__path__)
             if m.name not in bench.SUITES and m.name != "harness"]
    return tuple(name.replace("_", "-") for name in tuple(bench.SUITES) + tuple(sorted(extra)))


@cli.command()
@click.option("--quick", is_flag=True, help="Fewer shapes or rounds, for a fast look.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True, help="Folder for <suite>.csv and <suite>.png.")
@click.argument("names", nargs=-1, metavar="[SUITE]... | models [MODEL]...")
def bench(quick, out, names):
    """Benchmark SUITEs (default: conv2d, avg_pool2d, batch_norm) against PyTorch on the GPU; `models` takes the
    torchvision models to train (default: the five it lists), and `host` times each op's host path.

    Prints each table, writes <suite>.csv and a PNG chart of the speed-up per case.
    """
    from rich.console import Console

    from . import bench as bench_package
    from .bench import harness

    known = bench_suites()
    suites, arguments = (names[:1], names[1:]) if names[:1] == ("models",) else (names, ())
    unknown = [name for name in suites if name not in known]
    if unknown:
        raise click.BadParameter(f"unknown suite(s) {', '.join(unknown)}; expected some of {', '.join(known)}",
                                 param_hint="SUITE")
    harness.require_gpu()
    console = Console(stderr=True)
    for name in suites or bench_package.SUITES:
        module = importlib.import_module(f"nnkernels.bench.{name.replace('-', '_')}")
        with console.status(f"benchmarking {name} ..."):
            rows = module.run(quick, *([arguments] if arguments else []))
        click.echo(harness.report(rows, out, name, f"nnkernels bench {name}: speed-up over PyTorch"))
        click.echo(f"wrote {out / f'{name}.csv'} and {out / f'{name}.png'}\n")


def main(argv=None):
    """Console-script entry point: run the command, map failures to exit codes (see module docstring)."""
    _state["debug"] = False
    try:
        code = cli.main(args=argv, prog_name="nnkernels", standalone_mode=False)
    except click.ClickException as err:  # UsageError and BadParameter: exit code 2
        err.show()
        code = err.exit_code
    except click.exceptions.Abort:
        click.echo("nnkernels: aborted", err=True)
        code = 1
    except Exception as err:  # every failure becomes one line, or a traceback with --debug
        if _state["debug"]:
            traceback.print_exc()
        else:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            message = lines[0][:300] if lines else type(err).__name__
            click.echo(f"nnkernels: error: {message} (run with --debug for the traceback)", err=True)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)
