"""`nnkernels demo`: a small CNN trained on scikit-learn's digits through nnkernels, beside its torch twin.

Two copies of one network (conv -> batch norm -> ReLU -> avg-pool, twice, then a linear head):
one built from `nnkernels.nn` layers, one from `torch.nn`, starting from the same weights (the
twin's state_dict loads into ours unchanged), fed the same batches, stepped by the same
optimiser. The digits (1797 8x8 images) ship inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from pathlib import Path

import click
import torch

from . import nn as nnk
from .kernel import INTERPRETED

# Chosen so the CPU run (Triton's interpreter, 2 cores) stays well under 3 minutes at >= 90% accuracy.
DEFAULT_EPOCHS = 3
DEFAULT_BATCH_SIZE = 128
LEARNING_RATE = 0.01
TEST_FRACTION = 0.2


def check_device(device: str):
    """`--device cuda` where this process cannot use a GPU is bad usage, said before any work."""
    if device == "cuda" and (INTERPRETED or not torch.cuda.is_available()):
        raise click.BadParameter(
            "cuda: no CUDA device here (or TRITON_INTERPRET=1 is set); use --device cpu or auto",
            param_hint="--device",
        )
    if device == "cpu" and not INTERPRETED:
        raise click.BadParameter(
            "cpu: this process runs Triton compiled for the GPU; the CPU needs TRITON_INTERPRET=1 set "
            "before nnkernels is imported",
            param_hint="--device",
        )


def check_out(out: Path):
    """An `--out` that cannot hold the results is bad usage, said before any training: the folder is made
    (with its parents) and a file written and removed there."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise click.BadParameter(f"{out}: cannot write there ({err.strerror or err})", param_hint="--out") from None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def load_digits(seed: int, device):
    """The digits as (N, 1, 8, 8) fp32 images standardised with the training set's statistics,
    split into train and test sets by a seeded shuffle."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:num_test], order[num_test:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return (images[train].to(device), labels[train].to(device)), (images[test].to(device), labels[test].to(device))


def make_cnn(layers) -> torch.nn.Sequential:
    """The demo network, from `layers` (the `torch.nn` module or `nnkernels.nn`) for its conv,
    batch norm and pooling: 1x8x8 -> 16x4x4 -> 32x2x2 -> 10 logits."""
    return torch.nn.Sequential(
        layers.Conv2d(1, 16, kernel_size=3, padding=1, bias=False),
        layers.BatchNorm2d(16),
        torch.nn.ReLU(),
        layers.AvgPool2d(2),
        layers.Conv2d(16, 32, kernel_size=3, padding=1, bias=False),
        layers.BatchNorm2d(32),
        torch.nn.ReLU(),
        layers.AvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 2 * 2, 10),
    )


def accuracy(model, images, labels) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(dim=1) == labels).sum().item()
    model.train()
    return correct / len(labels)


def train_twins(train_x, train_y, epochs, batch_size, device, seed, on_step=None):
    """Train the nnkernels network and its torch twin side by side; returns (ours, twin, history).

    history["nnkernels"] and history["torch"] hold each step's training loss.
    """
    torch.manual_seed(seed)
    twin = make_cnn(torch.nn).to(device)
    ours = make_cnn(nnk).to(device)
    ours.load_state_dict(twin.state_dict())
    optimisers = [torch.optim.Adam(m.parameters(), lr=LEARNING_RATE) for m in (ours, twin)]
    history = {"nnkernels": [], "torch": []}
    batch_order = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        # Full batches only (the remainder is dropped, as DataLoader(drop_last=True) does): one
        # shape per layer, so each kernel specialisation compiles once.
        order = torch.randperm(len(train_y), generator=batch_order)
        for batch in order.split(batch_size)[: len(train_y) // batch_size]:
            batch = batch.to(device)
            for model, optimiser, key in ((ours, optimisers[0], "nnkernels"), (twin, optimisers[1], "torch")):
                loss = torch.nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                history[key].append(loss.item())
            if on_step:
                on_step(history)
    return ours, twin, history


# A kernel object's id: function name, element type, constants (see nnkernels.kernel).
KERNEL_ID = re.compile(r"^[a-z0-9_]+__(fp32|fp16|bf16)__[0-9a-z_]+$")


@contextlib.contextmanager
def _record_kernels():
    """Collect the ids of the kernel objects launched inside the block.

    The functional ops log every launch at DEBUG level on the "nnkernels" logger with the
    kernel ids among the message's arguments; this listens there for the duration.
    """
    ids: set = set()

    class Collect(logging.Handler):
        def emit(self, record):
            for arg in record.args if isinstance(record.args, tuple) else ():
                for word in str(arg).split(", "):  # one id, or several joined by ", "
                    if KERNEL_ID.match(word):
                        ids.add(word)

    logger = logging.getLogger("nnkernels")
    handler, level, propagate = Collect(logging.DEBUG), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the DEBUG lines are for this collector, not for the user's handlers
    try:
        yield ids
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def plot_losses(history, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["torch"], label="torch.nn", linewidth=3, alpha=0.5, color="tab:blue")
    ax.plot(history["nnkernels"], label="nnkernels.nn", linewidth=1.2, color="tab:orange")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def _exact_and_untuned():
    """For the run: fp32 convolutions without TF32 on both sides, so the two loss curves differ
    only by fp32 rounding; and no block-size tuning unless NNKERNELS_TUNE asks for it, because
    timing candidates costs more than it saves on a network this small."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, os.environ.get("NNKERNELS_TUNE"))
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.setdefault("NNKERNELS_TUNE", "off")
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
        if saved[2] is None:
            os.environ.pop("NNKERNELS_TUNE", None)


def run(epochs=None, batch_size=None, device="auto", seed=0, out=Path("demo-out"), limit=None, console=None) -> dict:
    """The whole demo: train both networks with a progress bar, print the results, save PNG + JSON.

    `limit` trains on the first `limit` training images only (quick checks); the test set stays whole. Without
    `batch_size`, a batch is DEFAULT_BATCH_SIZE images, or all of them where there are fewer.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    epochs = epochs or DEFAULT_EPOCHS
    check_out(out)
    if device == "auto":
        device = "cpu" if INTERPRETED else "cuda"
    console = console or Console()
    started = time.perf_counter()
    (train_x, train_y), (test_x, test_y) = load_digits(seed, device)
    train_x, train_y = train_x[:limit], train_y[:limit]
    batch_size = batch_size or min(DEFAULT_BATCH_SIZE, len(train_y))
    steps_per_epoch = len(train_y) // batch_size
    if steps_per_epoch == 0:
        raise click.BadParameter(f"{batch_size} is more than the {len(train_y)} training images",
                                 param_hint="--batch-size")
    where = "GPU, Triton compiled" if device == "cuda" else "CPU, Triton's interpreter"
    console.print(f"nnkernels demo: digits {len(train_y)} train / {len(test_y)} test, {_plural(epochs, 'epoch')} of "
                  f"{_plural(steps_per_epoch, 'step')}, batch {batch_size}, Adam lr {LEARNING_RATE}, on the {where}")
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=console)

    def on_step(history):
        progress.update(task, advance=1,
                        description=f"loss nnkernels {history['nnkernels'][-1]:.4f}  torch {history['torch'][-1]:.4f}")

    with progress, _record_kernels() as kernels, _exact_and_untuned():
        task = progress.add_task("", total=epochs * steps_per_epoch)
        ours, twin, history = train_twins(train_x, train_y, epochs, batch_size, device, seed, on_step)
        ours_accuracy = accuracy(ours, test_x, test_y)
        twin_accuracy = accuracy(twin, test_x, test_y)
    seconds = time.perf_counter() - started
    loss_gap = max(abs(a - b) for a, b in zip(history["nnkernels"], history["torch"]))
    summary = {
        "device": device,
        "epochs": epochs,
        "batch_size": batch_size,
        "seed": seed,
        "train_images": len(train_y),
        "test_images": len(test_y),
        "test_accuracy": {"nnkernels": ours_accuracy, "torch": twin_accuracy},
        "max_loss_difference": loss_gap,
        "final_loss": {"nnkernels": history["nnkernels"][-1], "torch": history["torch"][-1]},
        "kernels_ran": sorted(kernels),
        "seconds": round(seconds, 2),
        "loss_curves": history,
    }
    out.mkdir(parents=True, exist_ok=True)
    plot_losses(history, out / "loss_curves.png",
                f"digits CNN, {device}: nnkernels {ours_accuracy:.1%} vs torch {twin_accuracy:.1%} test accuracy")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"test accuracy: nnkernels {ours_accuracy:.2%}, torch.nn {twin_accuracy:.2%}")
    console.print(f"largest difference between the two training losses: {loss_gap:.3e}")
    specialisations: dict = {}
    for kernel_id in kernels:
        name = kernel_id.split("__")[0]
        specialisations[name] = specialisations.get(name, 0) + 1
    console.print(f"kernels that ran ({len(kernels)} specialisations, all ids in summary.json): "
                  + ", ".join(f"{name} x{n}" for name, n in sorted(specialisations.items())))
    console.print(f"wrote {out / 'loss_curves.png'} and {out / 'summary.json'} in {seconds:.1f} s")
    return summary
