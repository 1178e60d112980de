"""examples/train_fsdp.py under torchrun, two gloo ranks on the CPU (Triton interpreted, CUDA hidden so that any
machine runs the CPU path), the tiny net with --sync-bn at 8x8 for two steps: FSDP2 (`fully_shard`) of the
converted model runs there; the loss printed for each step is finite; both ranks hold the same full parameters
and batch-norm statistics (the example's --check-agree, and the tensors each rank saves); and they are those of
one process training torch's own (unconverted) layers over the same global batches, in float64.

With --sync-bn the ranks normalise over the global batch and FSDP2 averages their gradients, so the two
ranks' steps are the single process's steps over the whole batch."""
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_fsdp.py"
WORLD_SIZE, GLOBAL_BATCH, IMAGE_SIZE, STEPS, LR, SEED = 2, 4, 8, 2, 0.1, 5


def load_example():
    spec = importlib.util.spec_from_file_location("train_fsdp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(example):
    """The parameters and buffers before and after STEPS steps of torch's layers (no nnkernels) in float64 over
    the global batches, and each step's loss."""
    torch.manual_seed(SEED)
    model = example.tiny_net().double()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimiser = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        images, labels = example.global_batch(step, SEED, GLOBAL_BATCH, IMAGE_SIZE)
        loss = torch.nn.functional.cross_entropy(model(images.double()), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    after = {name: t.detach().clone() for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    return before, after, losses


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def test_fsdp2_example_on_two_gloo_cpu_ranks_agrees_and_matches_one_process(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", NNKERNELS_TUNE="off", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # --standalone: a rendezvous on a free port of localhost, so runs side by side do not collide
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               str(SCRIPT), "--model", "tiny", "--sync-bn", "--steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH),
               "--image-size", str(IMAGE_SIZE), "--lr", str(LR), "--seed", str(SEED), "--no-tf32", "--check-agree",
               "--save-params", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "--sync-bn: 5 batch norms are nnkernels.nn.SyncBatchNorm" in done.stdout, done.stdout
    losses = [float(x) for x in re.findall(rf"^step \d+/{STEPS}: loss (\S+)$", done.stdout, re.MULTILINE)]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), done.stdout
    assert "--check-agree: 2 ranks agree on" in done.stdout, done.stdout

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 0
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"ranks disagree on {name}"
        assert not ranks[0][name].is_floating_point() or torch.isfinite(ranks[0][name]).all(), name

    before, after, ref_losses = reference(load_example())
    assert ranks[0].keys() == after.keys()
    for loss, ref_loss in zip(losses, ref_losses):
        assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), f"loss {loss} != {ref_loss} (one process)"
    # The updates (after - before), not the parameters: these would hide a wrong step under lr.
    update = torch.cat([(ranks[0][n].double() - before[n]).flatten() for n in before])
    ref_update = torch.cat([(after[n] - before[n]).flatten() for n in before])
    assert ref_update.norm() > 0
    assert rel(update, ref_update) < 1e-4, f"update relative error {rel(update, ref_update):.2e}"
    for name in before:
        error = rel(ranks[0][name].double() - before[name], after[name] - before[name])
        assert error < 1e-3, f"{name}: update relative error {error:.2e}"
    for name in after.keys() - before.keys():  # buffers: running statistics of the global batch, batch counts
        assert rel(ranks[0][name], after[name]) < 1e-5, f"{name}: {ranks[0][name]} != {after[name]}"
