"""`nnkernels demo` in a tiny setting: exit code, printed results, loss-curve PNG and JSON summary,
and the nnkernels network tracking its torch twin step for step; what it refuses before training."""
import json
import sys

import click
import pytest

from nnkernels import demo
from nnkernels.cli import cli, main


def test_command_defaults_are_the_demo_defaults():
    options = {p.name: p for p in cli.commands["demo"].params if isinstance(p, click.Option)}
    assert options["epochs"].default == demo.DEFAULT_EPOCHS
    # No batch-size default in the command: the demo's, or the LIMIT images where they are fewer.
    assert options["batch_size"].default is None
    assert f"[default: {demo.DEFAULT_BATCH_SIZE}, or LIMIT where that is smaller]" in options["batch_size"].help
    assert f"LIMIT of the {1797 - int(1797 * demo.TEST_FRACTION)} training images" in options["limit"].help


def run_demo(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(["demo", *args])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_an_out_folder_that_cannot_be_written_is_refused_before_training(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "train_twins", lambda *a, **k: pytest.fail("trained before checking --out"))
    (tmp_path / "a_file").write_text("")
    code, out, err = run_demo(capsys, "--out", str(tmp_path / "a_file" / "demo"))
    assert code == 2 and "--out" in err and "a_file" in err and out == ""


@pytest.mark.parametrize("missing", ["sklearn", "matplotlib"])
def test_without_the_demo_extra_it_says_what_to_install(capsys, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    code, out, err = run_demo(capsys, "--epochs", "1")
    assert code == 1 and out == ""
    assert missing in err and "pip install 'nnkernels[demo]'" in err and err.count("\n") == 1


def test_a_limit_below_the_default_batch_size_trains_on_one_batch(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "accuracy", lambda *_: 0.5)  # the whole test set is the slow part in the interpreter
    code, out, _ = run_demo(capsys, "--epochs", "1", "--limit", "32", "--out", str(tmp_path))
    assert code == 0, out
    assert "32 train / 359 test, 1 epoch of 1 step, batch 32," in " ".join(out.split())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["batch_size"] == 32 and len(summary["loss_curves"]["nnkernels"]) == 1


def test_tiny_demo_trains_both_networks_and_writes_its_files(capsys, tmp_path):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--epochs", "2", "--batch-size", "128", "--limit", "256", "--seed", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert exited.value.code == 0, printed
    assert "test accuracy: nnkernels" in printed and "kernels that ran" in printed
    assert "2 epochs of 2 steps, batch 128" in " ".join(printed.split())

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["epochs"], summary["batch_size"], summary["seed"]) == (2, 128, 1)
    assert (summary["train_images"], summary["test_images"]) == (256, 359)
    # The two networks are "nnkernels" and "torch" in every part of the summary.
    for part in ("test_accuracy", "final_loss", "loss_curves"):
        assert set(summary[part]) == {"nnkernels", "torch"}, part
    steps = len(summary["loss_curves"]["nnkernels"])
    assert steps == len(summary["loss_curves"]["torch"]) == 4  # 2 epochs of 256 / 128 batches
    # Same weights, same batches, same optimiser: the two losses agree to fp32 rounding.
    assert summary["max_loss_difference"] < 1e-4
    ours, twin = summary["test_accuracy"]["nnkernels"], summary["test_accuracy"]["torch"]
    assert 0.0 <= ours <= 1.0 and abs(ours - twin) <= 0.01
    assert summary["loss_curves"]["nnkernels"][-1] < summary["loss_curves"]["nnkernels"][0], "the loss went down"
    # Every layer kind ran through nnkernels, forward and backward.
    kernels = " ".join(summary["kernels_ran"])
    for kind in ("conv2d", "pool", "batch_norm"):
        assert kind in kernels, f"no {kind} kernel in {summary['kernels_ran']}"
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
