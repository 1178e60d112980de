"""`nnkernels demo` in a tiny setting: exit code, printed results, loss-curve PNG and JSON summary,
and the nnkernels network tracking its torch twin step for step."""
import json

import click
import pytest

from nnkernels import demo
from nnkernels.cli import cli, main


def test_command_defaults_are_the_demo_defaults():
    options = {p.name: p.default for p in cli.commands["demo"].params if isinstance(p, click.Option)}
    assert (options["epochs"], options["batch_size"]) == (demo.DEFAULT_EPOCHS, demo.DEFAULT_BATCH_SIZE)


def test_tiny_demo_trains_both_networks_and_writes_its_files(capsys, tmp_path):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--epochs", "2", "--batch-size", "128", "--limit", "256", "--seed", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert exited.value.code == 0, printed
    assert "test accuracy: nnkernels" in printed and "kernels that ran" in printed

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["epochs"], summary["batch_size"], summary["seed"]) == (2, 128, 1)
    assert (summary["train_images"], summary["test_images"]) == (256, 359)
    steps = len(summary["loss_curves"]["ours"])
    assert steps == len(summary["loss_curves"]["torch"]) == 4  # 2 epochs of 256 / 128 batches
    # Same weights, same batches, same optimiser: the two losses agree to fp32 rounding.
    assert summary["max_loss_difference"] < 1e-4
    ours, twin = summary["test_accuracy"]["nnkernels"], summary["test_accuracy"]["torch"]
    assert 0.0 <= ours <= 1.0 and abs(ours - twin) <= 0.01
    assert summary["loss_curves"]["ours"][-1] < summary["loss_curves"]["ours"][0], "the loss went down"
    # Every layer kind ran through nnkernels, forward and backward.
    kernels = " ".join(summary["kernels_ran"])
    for kind in ("conv2d", "pool", "batch_norm"):
        assert kind in kernels, f"no {kind} kernel in {summary['kernels_ran']}"
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
