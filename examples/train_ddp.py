"""Train a converted torchvision ResNet-18 on random data with DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/train_ddp.py [--steps 20] [--batch-size 64] [--amp] [--sync-bn]

One process per GPU, through NCCL (`--backend gloo` lets ranks share a GPU, to try it on one). `nnkernels.nn.convert` swaps the model's convolutions, batch
norms and poolings for nnkernels layers before DDP wraps it; nothing else changes. Each
rank trains on its shard of a global batch drawn from a seeded generator, so a run is
reproducible and `tests/test_ddp.py` can replay it in a single process.

Batch norm, as with torch.nn.BatchNorm2d under DDP, normalises with each rank's own batch
statistics; `--sync-bn` converts the batch norms to `nnkernels.nn.SyncBatchNorm`, which normalises with
the statistics of the global batch (DDP accepts SyncBatchNorm layers on GPU modules only). `--model tiny` (a
few layers) and a machine without CUDA (gloo, the ranks on the CPU, Triton interpreted, no --sync-bn) make a
run small enough to try anywhere.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

NUM_CLASSES = 10


def build_model(seed: int, model: str = "resnet18", sync_bn: bool = False) -> torch.nn.Module:
    """torchvision's resnet18, or a tiny conv net (random weights from `seed`), converted to nnkernels layers;
    with `sync_bn`, its batch norms synchronised over the ranks."""
    from nnkernels.nn import SyncBatchNorm, convert

    torch.manual_seed(seed)
    if model == "tiny":
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AvgPool2d(2), torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, NUM_CLASSES))
    else:
        import torchvision

        net = torchvision.models.resnet18(num_classes=NUM_CLASSES)
    net = convert(net)
    return SyncBatchNorm.convert_sync_batchnorm(net) if sync_bn else net


def global_batch(step: int, seed: int, batch_size: int, image_size: int):
    """The global batch of `step`: images and labels from a generator seeded by (seed, step), on the CPU."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return images, labels


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a global batch."""
    return tensor.chunk(world_size)[rank]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over ranks")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--sync-bn", action="store_true", help="batch statistics over every rank (SyncBatchNorm)")
    parser.add_argument("--model", choices=["resnet18", "tiny"], default="resnet18")
    parser.add_argument("--no-tf32", action="store_true", help="exact fp32 convolutions (for comparisons)")
    parser.add_argument("--save-params", type=Path, default=None,
                        help="after training, each rank saves its parameters to DIR/rank<r>.pt")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size: expected a multiple of the {world_size} ranks, got {args.batch_size}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif args.backend == "gloo":
        device = torch.device("cpu")  # Triton interpreted (nnkernels chooses it where there is no CUDA)
    else:
        raise SystemExit("--backend nccl: expected CUDA devices; without them use --backend gloo")
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    model = build_model(args.seed, args.model, args.sync_bn).to(device)
    if rank == 0:
        print(model.nnkernels_summary, flush=True)
    device_ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimiser = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        images, labels = global_batch(step, args.seed, args.batch_size, args.image_size)
        images = shard(images, rank, world_size).to(device)
        labels = shard(labels, rank, world_size).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {mean_loss.item() / world_size:.4f}", flush=True)
    if args.save_params:
        args.save_params.mkdir(parents=True, exist_ok=True)
        params = {name: p.detach().cpu() for name, p in model.module.named_parameters()}
        torch.save(params, args.save_params / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
