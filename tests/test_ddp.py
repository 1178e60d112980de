"""examples/train_ddp.py under torchrun, two ranks: one step gives the same parameters on both
ranks, and the same as one process stepping over the same global batch. NCCL with one GPU per
rank (skipped with fewer than 2 GPUs); gloo with both ranks on one GPU (any CUDA machine).

Both sides run untuned (NNKERNELS_TUNE=off), so that they launch the same kernels: a step's update is
ill-conditioned at this size (ReLU masks and max-pool choices flip on rounding-level differences). On the
H200 (2026-12, torch 2.11) the single-process update's error against
float64 was 7.1e-3 for cuDNN's fp32 and for our direct kernels, 2.2e-6 with Winograd; DDP ranks that tuned
into other choices than the reference's differed from it by 7.3e-4."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import INTERPRETED

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ddp.py"
WORLD_SIZE = 2
GLOBAL_BATCH = 8
IMAGE_SIZE = 64
LR = 0.1

GPUS = 0 if INTERPRETED or not torch.cuda.is_available() else torch.cuda.device_count()
BACKENDS = [
    pytest.param("nccl", marks=pytest.mark.skipif(GPUS < WORLD_SIZE, reason="needs 2 CUDA devices")),
    pytest.param("gloo", marks=pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")),
]


def load_example():
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process_step(example, seed):
    """One SGD step of the same model over the same global batch on one GPU.

    DDP averages the ranks' gradients, and each rank's batch norm uses its own shard's
    statistics; so the single process runs each shard forward and backward (loss / ranks)
    and steps once on the summed gradients, which is the same update.
    """
    model = example.build_model(seed).cuda()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimiser = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    images, labels = example.global_batch(0, seed, GLOBAL_BATCH, IMAGE_SIZE)
    for rank in range(WORLD_SIZE):
        shard_images = example.shard(images, rank, WORLD_SIZE).cuda()
        shard_labels = example.shard(labels, rank, WORLD_SIZE).cuda()
        loss = torch.nn.functional.cross_entropy(model(shard_images), shard_labels) / WORLD_SIZE
        loss.backward()
    optimiser.step()
    after = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return {name: t.cpu() for name, t in before.items()}, after


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_ddp_step_matches_single_process(tmp_path, backend, monkeypatch):
    seed = 3
    env = dict(os.environ, NNKERNELS_TUNE="off",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
               str(SCRIPT), "--backend", backend, "--steps", "1", "--batch-size", str(GLOBAL_BATCH), "--image-size", str(IMAGE_SIZE),
               "--lr", str(LR), "--seed", str(seed), "--no-tf32", "--save-params", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 0
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"ranks disagree on {name}"

    monkeypatch.setenv("NNKERNELS_TUNE", "off")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        before, reference = single_process_step(load_example(), seed)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    # Compare the updates (after - before): the parameters alone would hide a wrong step under lr.
    ddp_update = torch.cat([(ranks[0][n].double() - before[n].double()).flatten() for n in reference])
    ref_update = torch.cat([(reference[n].double() - before[n].double()).flatten() for n in reference])
    assert ref_update.norm() > 0
    total_error = ((ddp_update - ref_update).norm() / ref_update.norm()).item()
    assert total_error < 1e-4, f"update relative error {total_error:.2e}"
    for name in reference:
        update = ranks[0][name].double() - before[name].double()
        expected = reference[name].double() - before[name].double()
        error = ((update - expected).norm() / expected.norm().clamp_min(1e-30)).item()
        assert error < 1e-2, f"{name}: update relative error {error:.2e}"
