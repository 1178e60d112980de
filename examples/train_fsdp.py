"""Train a converted ResNet-50 (or a tiny conv net) on random data with FSDP2 (`fully_shard`).

    torchrun --nproc-per-node 2 examples/train_fsdp.py [--model resnet50|tiny] [--steps 20] [--batch-size 64]
                                                       [--image-size 128] [--amp] [--sync-bn]

One process per GPU through NCCL where CUDA is there; otherwise the ranks run on the CPU through gloo, with
Triton interpreted (nnkernels chooses it where there is no CUDA), which FSDP2 (torch>=2.6) supports too.
`nnkernels.nn.convert` swaps the model's convolutions, batch norms and poolings for nnkernels layers (and
`--sync-bn` then makes its batch norms `nnkernels.nn.SyncBatchNorm`) before `fully_shard` shards it: each
residual block (ResNet-50's bottlenecks, the tiny net's blocks) is its own FSDP unit, then the root takes the
rest (stem, head), as the FSDP2 docs recommend. Inside a unit's forward and backward FSDP2 hands the layers
plain unsharded tensors, so the nnkernels layers run unchanged; parameters are sharded between steps
(DTensors), buffers (batch-norm running statistics) are not.

Each rank trains on its shard of a global batch drawn from a seeded generator, so a run is reproducible and
`tests/test_examples_fsdp.py` can replay it in a single process. Gradients are averaged over the ranks (FSDP2's
reduce-scatter), as under DDP. Batch norm normalises with each rank's own batch statistics; `--sync-bn` with
those of the global batch (unlike DDP, FSDP2 takes SyncBatchNorm layers on CPU modules as well).

`--amp` runs the forward under bf16 `torch.autocast` on the device the ranks use: CUDA, or the CPU (nnkernels'
kernels take bf16 in the interpreter too, so CPU ranks try the same mixed-precision path, slowly). Parameters
and their FSDP shards stay float32. `--model tiny --image-size 16 --batch-size 4` on CPU ranks makes a run
small enough to try anywhere (ResNet-50 interpreted is not: one step at 32x32 took over 9 minutes on two CPU
cores); ResNet-50 needs torchvision.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

NUM_CLASSES = 10


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                               torch.nn.BatchNorm2d(cout), torch.nn.ReLU())


class TinyBlock(torch.nn.Module):
    """A residual block in small: conv-bn-relu, conv-bn, plus the input (an FSDP unit, like a bottleneck)."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = torch.nn.Sequential(conv_bn_relu(channels, channels),
                                        torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                        torch.nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(self.body(x) + x)


def tiny_net(width: int = 8) -> torch.nn.Sequential:
    return torch.nn.Sequential(conv_bn_relu(3, width), torch.nn.AvgPool2d(2), TinyBlock(width), TinyBlock(width),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, NUM_CLASSES))


def block_types(model: str) -> tuple[type, ...]:
    """The module classes that become FSDP units of their own (the root, wrapped last, takes the rest)."""
    if model == "tiny":
        return (TinyBlock,)
    from torchvision.models.resnet import BasicBlock, Bottleneck

    return (Bottleneck, BasicBlock)


def build_model(seed: int, model: str = "resnet50", sync_bn: bool = False) -> torch.nn.Module:
    """torchvision's resnet50, or the tiny conv net (random weights from `seed`), converted to nnkernels layers;
    with `sync_bn`, its batch norms synchronised over the ranks."""
    from nnkernels.nn import SyncBatchNorm, convert

    torch.manual_seed(seed)
    if model == "tiny":
        net = tiny_net()
    else:
        try:
            import torchvision
        except ImportError:
            raise SystemExit("--model resnet50 needs torchvision (`pip install torchvision`, the build matching "
                             "your torch); --model tiny needs nothing more") from None
        net = torchvision.models.resnet50(num_classes=NUM_CLASSES)
    net = convert(net)
    return SyncBatchNorm.convert_sync_batchnorm(net) if sync_bn else net


def shard_model(net: torch.nn.Module, blocks: tuple[type, ...], mesh) -> torch.nn.Module:
    """FSDP2: every module of a class in `blocks` sharded as its own unit, then the root (which keeps the
    parameters no unit took). `fully_shard` turns the modules into FSDP modules in place."""
    from torch.distributed.fsdp import fully_shard

    for module in net.modules():
        if isinstance(module, blocks):
            fully_shard(module, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def global_batch(step: int, seed: int, batch_size: int, image_size: int):
    """The global batch of `step`: images and labels from a generator seeded by (seed, step), on the CPU."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return images, labels


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a global batch."""
    return tensor.chunk(world_size)[rank]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (its shards all-gathered: a collective, so every rank calls it) and every buffer
    (not sharded: each rank's own), on the CPU."""
    from torch.distributed.tensor import DTensor

    state = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
             for name, p in model.named_parameters()}
    state.update({name: b.detach().cpu() for name, b in model.named_buffers()})
    return state


def check_agree(state: dict[str, torch.Tensor], rank: int, buffers: bool) -> None:
    """Every rank holds the same full parameters (and, with `buffers`, the same buffers): a float64 checksum per
    tensor, all-gathered over the ranks and compared exactly. Buffers (batch-norm running statistics) agree only
    where batch norm is synchronised (--sync-bn); otherwise each rank keeps its own, as under DDP."""
    names = [name for name in state if buffers or not name.endswith(("running_mean", "running_var"))]
    sums = [state[name].double().sum().item() + state[name].double().abs().sum().item() for name in names]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)  # objects: gloo and nccl alike, whatever the device
    for other, theirs in enumerate(gathered):
        differ = [name for name, mine, their in zip(names, sums, theirs) if mine != their]
        if differ:
            raise SystemExit(f"--check-agree: rank {rank} and rank {other} disagree on {', '.join(differ[:5])}"
                             + (f" and {len(differ) - 5} more" if len(differ) > 5 else ""))
    if rank == 0:
        what = "parameters and buffers" if buffers else "parameters (running statistics are per rank without --sync-bn)"
        print(f"--check-agree: {len(gathered)} ranks agree on {len(names)} {what}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="nccl: CUDA ranks; gloo: CPU ranks, Triton interpreted (default: nccl where CUDA is "
                             "there, gloo otherwise)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over ranks")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (on CUDA, and on CPU ranks too)")
    parser.add_argument("--sync-bn", action="store_true", help="batch statistics over every rank (SyncBatchNorm)")
    parser.add_argument("--model", choices=["resnet50", "tiny"], default="resnet50")
    parser.add_argument("--no-tf32", action="store_true", help="exact fp32 convolutions (for comparisons)")
    parser.add_argument("--check-agree", action="store_true",
                        help="after training, check that every rank holds the same full parameters (and buffers, "
                             "with --sync-bn)")
    parser.add_argument("--save-params", type=Path, default=None,
                        help="after training, each rank saves its full parameters and buffers to DIR/rank<r>.pt")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    if args.model == "resnet50" and importlib.util.find_spec("torchvision") is None:
        build_model(args.seed, args.model)  # its message, before any process group is made
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl: expected CUDA devices; without them use --backend gloo (CPU ranks)")
    if backend == "gloo" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--backend gloo runs the ranks on the CPU, where Triton must run interpreted: set "
                         "TRITON_INTERPRET=1 (or hide the GPUs, CUDA_VISIBLE_DEVICES=)")
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size: expected a multiple of the {world_size} ranks, got {args.batch_size}")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")  # Triton interpreted (nnkernels chooses it where there is no CUDA)
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    model = build_model(args.seed, args.model, args.sync_bn).to(device)
    if rank == 0:
        print(model.nnkernels_summary, flush=True)
        if args.sync_bn:
            from nnkernels.nn import SyncBatchNorm

            synced = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
            print(f"--sync-bn: {synced} batch norms are nnkernels.nn.SyncBatchNorm", flush=True)
    model = shard_model(model, block_types(args.model), init_device_mesh(device.type, (world_size,)))
    optimiser = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # over the shards (DTensors)
    for step in range(args.steps):
        images, labels = global_batch(step, args.seed, args.batch_size, args.image_size)
        images = shard(images, rank, world_size).to(device)
        labels = shard(labels, rank, world_size).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world_size
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {mean_loss:.4f}", flush=True)
        if not math.isfinite(mean_loss):
            raise SystemExit(f"step {step + 1}: the loss is {mean_loss}")
    if args.check_agree or args.save_params:
        state = full_state(model)
        if args.check_agree:
            check_agree(state, rank, buffers=args.sync_bn)
        if args.save_params:
            args.save_params.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.save_params / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
