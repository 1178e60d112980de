"""The `nnkernels` command: demo, tune, compile, list, bench.

Exit codes: 0 success, 2 bad usage (click's own usage errors), 1 failure. A failure prints
one line, `nnkernels: error: ...`; `nnkernels --debug ...` prints the traceback instead.

Only click is imported here: torch, Triton and the kernels are imported inside the commands, so that
`--help` and bad usage answer at once.
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
# nnkernels.kernel.COMPILE_TARGETS, written out so that `compile --help` need not import Triton
# (tests/test_cli_compile.py checks they agree).
COMPILE_TARGETS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120")

_state = {"debug": False}


def _print_version(ctx, _param, value):
    if value and not ctx.resilient_parsing:
        from . import __version__

        click.echo(f"nnkernels {__version__}")
        ctx.exit()


def require_extra(extra: str, *modules: str):
    """Import each of `modules` or fail in one line naming the extra that installs them."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} not installed; pip install 'nnkernels[{extra}]'")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="On failure, print the full traceback instead of one line.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the version and exit.")
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
@click.option("--batch-size", type=click.IntRange(min=2), default=None,
              help="Images per training step  [default: 128, or LIMIT where that is smaller]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: the GPU when there is one, else the CPU through Triton's interpreter.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the initial weights and batch order.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo-out"),
              show_default=True, help="Folder for loss_curves.png and summary.json (checked writable first).")
@click.option("--limit", type=click.IntRange(min=2), default=None,
              help="Train on the first LIMIT of the 1438 training images only, for a quick check (accuracy "
                   "suffers); the test set stays whole.")
def demo(epochs, batch_size, device, seed, out, limit):
    """Train a small CNN on scikit-learn's digits with nnkernels beside its torch.nn twin.

    Both start from the same weights and see the same batches; every convolution, batch
    norm and pooling of the nnkernels network, forward and backward, runs nnkernels'
    kernels. Prints both test accuracies, the largest loss difference and the kernels that
    ran; saves the loss curves (PNG) and a JSON summary. Needs the demo extra:
    pip install 'nnkernels[demo]'.
    """
    require_extra("demo", "matplotlib", "sklearn")
    from . import demo as demo_module

    demo_module.check_device(device)
    demo_module.check_out(out)
    demo_module.run(epochs=epochs, batch_size=batch_size, device=device, seed=seed, out=out, limit=limit)


@cli.command()
@click.argument("model", metavar="MODEL")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Images per step.")
@click.option("--image-size", type=click.IntRange(min=1), default=224, show_default=True,
              help="Height and width of the images.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="bf16 and fp16 run the step under torch.autocast, as mixed-precision training does.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: the GPU when there is one, else the CPU through Triton's interpreter.")
@click.option("--channels-last", is_flag=True, help="Model and images in torch.channels_last.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Compile the layers' kernels in this many processes beside the step (GPU; default: one per "
                   "CPU, at most 16; 1: as the step runs).")
def tune(model, batch_size, image_size, dtype, device, channels_last, jobs):
    """Compile and tune, ahead of training, every kernel one training step of MODEL needs.

    MODEL is a torchvision model name (resnet50; needs torchvision) or module:function, a function of no
    arguments returning a torch.nn.Module. The model is converted with nnkernels.convert and one forward and
    backward run on random images through nnkernels.warmup; on the GPU the tuned choices are remembered for
    the training that follows.
    """
    from . import demo, tune_model

    demo.check_device(device)
    tune_model.run(model, batch_size=batch_size, image_size=image_size, dtype=dtype, device=device,
                   channels_last=channels_last, jobs=jobs)


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
@click.option("--target", default="sm_90", show_default=True,
              help=f"GPU architecture: {', '.join(COMPILE_TARGETS)}.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder  [default: build/<target>]")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Element type(s) to build each kernel for (repeatable)  [default: fp32]")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Compiler processes run at once  [default: one per CPU, at most 16]")
@click.argument("kernels", nargs=-1, metavar="[KERNEL]...")
def compile_command(target, out, dtypes, jobs, kernels):
    """Compile the catalogue (or the named KERNELs) ahead of time; needs no GPU.

    Writes <id>.ptx and <id>.cubin for each kernel's example instance, and manifest.json:
    id, hash, entry-point name, signature, constants, target, shared memory, num_warps.
    Kernels compile in parallel child processes, with a progress bar when stderr is a terminal.
    """
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # Nothing here runs a kernel: with Triton compiled, the compiler processes fork from this one.
    os.environ.setdefault("TRITON_INTERPRET", "0")
    import torch

    from ._aot import compile_in_subprocess, default_jobs
    from .kernel import parse_target

    try:
        parse_target(target)
    except ValueError as err:
        raise click.BadParameter(str(err).split(": ", 1)[1], param_hint="--target") from None
    classes = _resolve_kernels(kernels)
    dtype_of = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    instances = [cls.example(dtype_of[d]) for cls in classes for d in (dtypes or ("fp32",))]
    out = out or Path("build") / target
    jobs = min(jobs, len(instances)) if jobs else default_jobs(len(instances))
    click.echo(f"compiling {len(instances)} kernel(s) for {target} in {jobs} process(es) ...", err=True)
    console = Console(stderr=True)
    progress = Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console, transient=True,
                        disable=not console.is_terminal)
    with progress:
        task = progress.add_task("", total=len(instances))
        built = compile_in_subprocess(instances, target, jobs,
                                      on_done=lambda kernel: progress.update(task, advance=1, description=kernel.id))
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


def signature_runs(arg_types) -> str:
    """A launch signature as runs of arguments of one type, in order: `dy, x, w: *dtype; B, C_IN: i32`."""
    runs: list = []
    for arg, kind in arg_types.items():
        kind = kind.replace("*D", "*dtype")
        if runs and runs[-1][1] == kind:
            runs[-1][0].append(arg)
        else:
            runs.append(([arg], kind))
    return "; ".join(f"{', '.join(args)}: {kind}" for args, kind in runs)


@cli.command("list")
def list_command():
    """Show the kernel catalogue: kernel, the functional op using it, constants and launch signature."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .kernel import catalogue

    users = kernel_users()
    # As wide as the terminal (80 columns where there is none): the names whole, the other cells wrapped.
    table = Table(title="nnkernels catalogue", box=box.SIMPLE_HEAD, show_lines=True, expand=True,
                  pad_edge=False)
    table.add_column("kernel (used by)", no_wrap=True, width=max(len(cls.__name__) for cls in catalogue()))
    table.add_column("constants (example)", overflow="fold", ratio=5)
    table.add_column("launch signature", overflow="fold", ratio=4)
    for cls in catalogue():
        constants = ", ".join(f"{c.lower()}={v}" for c, v in zip(cls.constant_names, cls.example_constants))
        used_by = ", ".join(users.get(cls, [])) or ("seed (spec)" if cls.seed else "-")
        table.add_row(f"{cls.__name__}\n[dim]({used_by})[/dim]", constants, signature_runs(cls._arg_types))
    Console().print(table)


def bench_suites() -> tuple:
    """Every suite `bench` runs, by the name it takes on the command line (a module of nnkernels.bench with run(),
    its underscores written as hyphens): the harness's SUITES first."""
    from . import bench

    extra = [m.name for m in pkgutil.iter_modules(bench.__path__)
             if m.name not in bench.SUITES and m.name != "harness"]
    return tuple(name.replace("_", "-") for name in tuple(bench.SUITES) + tuple(sorted(extra)))


def _model_convs_options(names, models, batch, precisions) -> dict:
    """`model-convs`' options (checked, with its model names) as run() takes them; BadParameter where they are
    given to another suite or name what it does not know."""
    if names[:1] not in (("model-convs",), ("model_convs",)):
        if batch is not None or precisions is not None:
            raise click.BadParameter("only the model-convs suite takes them", param_hint="--batch/--precisions")
        return {}
    from .bench.model_convs import MODELS, PRECISIONS

    unknown = [model for model in models if model not in MODELS]
    if unknown:
        raise click.BadParameter(f"unknown model(s) {', '.join(unknown)}; expected some of {', '.join(MODELS)}",
                                 param_hint="MODEL")
    options = {} if batch is None else {"batch": batch}
    if precisions is not None:
        chosen = tuple(p.strip() for p in precisions.split(",") if p.strip())
        if not chosen or any(p not in PRECISIONS for p in chosen):
            raise click.BadParameter(f"expected a comma-separated list of {', '.join(PRECISIONS)}, got {precisions!r}",
                                     param_hint="--precisions")
        options["precisions"] = chosen
    return options


@cli.command()
@click.option("--quick", is_flag=True, help="Fewer shapes or rounds, for a fast look.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"),
              show_default=True, help="Folder for <suite>.csv and <suite>.png.")
@click.option("--batch", type=click.IntRange(min=1), help="model-convs: the batch of the layers' inputs (32).")
@click.option("--precisions", help="model-convs: comma-separated, of bf16, tf32, fp32 (default: bf16,tf32).")
@click.argument("names", nargs=-1, metavar="[SUITE]... | models [MODEL]... | model-convs [MODEL]...")
def bench(quick, out, batch, precisions, names):
    """Benchmark SUITEs (default: conv2d, avg-pool2d, batch-norm) against PyTorch on the GPU; `models` takes the
    torchvision models to train (default: the five it lists), `model-convs` the models whose every convolution
    it times (default: ten), and `host` times each op's host path.

    Prints each table, writes <suite>.csv and a PNG chart of the speed-up per case. Needs the bench extra:
    pip install 'nnkernels[bench]'.
    """
    from rich.console import Console

    from . import bench as bench_package
    from .bench import harness

    known = bench_suites()
    takes_models = names[:1] in (("models",), ("model-convs",), ("model_convs",))
    suites, arguments = (names[:1], names[1:]) if takes_models else (names, ())
    options = _model_convs_options(names, arguments, batch, precisions)
    unknown = [name for name in suites if name.replace("_", "-") not in known]  # avg_pool2d as the module names it, too
    suites = tuple(name.replace("_", "-") for name in suites)
    if unknown:
        raise click.BadParameter(f"unknown suite(s) {', '.join(unknown)}; expected some of {', '.join(known)}",
                                 param_hint="SUITE")
    harness.require_gpu()
    require_extra("bench", "matplotlib", *(["torchvision"] if takes_models else []))
    console = Console(stderr=True)
    for name in suites or bench_package.SUITES:
        module = importlib.import_module(f"nnkernels.bench.{name.replace('-', '_')}")
        with console.status(f"benchmarking {name} ..."):
            rows = module.run(quick, *([arguments] if arguments else []), **options)
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
