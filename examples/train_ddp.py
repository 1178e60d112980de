"""Train a converted torchvision ResNet-18 on random data with DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/train_ddp.py [--steps 20] [--batch-size 64] [--amp]

One process per GPU, through NCCL (`--backend gloo` lets ranks share a GPU, to try it on one). `nnkernels.nn.convert` swaps the model's convolutions, batch
norms and poolings for nnkernels layers before DDP wraps it; nothing else changes. Each
rank trains on its shard of a global batch drawn from a seeded generator, so a run is
reproducible and `tests/test_ddp.py` can replay it in a single process.

Batch norm, as with torch.nn.BatchNorm2d under DDP, normalises with each rank's own batch
statistics (no SyncBatchNorm).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

NUM_CLASSES = 10


def build_model(seed: int) -> torch.nn.Module:
    """torchvision's resnet18 (random weights from `seed`), converted to nnkernels layers."""
    import torchvision

    from nnkernels.nn import convert

    torch.manual_seed(seed)
    return convert(torchvision.models.resnet18(num_classes=NUM_CLASSES))


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
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    model = build_model(args.seed).to(device)
    if rank == 0:
        print(model.nnkernels_summary, flush=True)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimiser = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        images, labels = global_batch(step, args.seed, args.batch_size, args.image_size)
        images = shard(images, rank, world_size).to(device)
        labels = shard(labels, rank, world_size).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
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
