"""Benchmark: nnkernels' SyncBatchNorm against torch's, forward + backward, on one GPU in a one-process nccl group.

ResNet-50's batch-norm shapes at batch 32 (224x224 input), training mode, bf16 and fp32 inputs (float32
parameters and running statistics, as autocast leaves them). Two ways per shape, each timed eagerly (the
collectives and torch's host synchronisation keep both out of a CUDA graph) with `triton.testing.do_bench`:
- "collectives": the synchronising path itself, ours (`sync_batch_norm`) against torch's autograd function
  (`torch.nn.modules._functions.SyncBatchNorm`), both with their all-gathers and all-reduce over the one rank;
- "module": `nnkernels.nn.SyncBatchNorm` against `torch.nn.SyncBatchNorm`, which with one rank both run as
  plain batch norm, as a user's one-GPU run does.
A row's time is ms per forward + backward (dx, dweight, dbias); its bytes 8Ne (3Ne forward, 5Ne backward).

    nnkernels bench sync-batch-norm
"""
from __future__ import annotations

import torch

from .harness import Row, require_gpu, time_ms

# (channels, plane side) of ResNet-50's batch norms at 224x224, each once.
RESNET50_SHAPES = ((64, 112), (64, 56), (256, 56), (128, 56), (128, 28), (512, 28), (256, 28), (256, 14),
                   (1024, 14), (512, 14), (512, 7), (2048, 7))
BATCH = 32
DTYPES = (torch.bfloat16, torch.float32)


def _one_rank_group() -> bool:
    """Make the default process group, nccl over an in-process store with this process its one rank, unless one
    exists; whether it made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"sync-batch-norm: expected one process (a one-rank group), got a process group of "
                               f"{dist.get_world_size()} ranks")
        return False
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    return True


def _step(forward, x, dy):
    def step():
        x.grad = None
        forward(x).backward(dy)
    return step


def _collectives(group, channels):
    """(ours, torch's) forward functions through the synchronising path over `group`'s one rank."""
    from torch.nn.modules._functions import SyncBatchNorm as TorchSync

    from ..functional.sync_batchnorm import sync_batch_norm

    def parameters():
        return (torch.randn(channels, device="cuda").requires_grad_(),
                torch.randn(channels, device="cuda").requires_grad_(),
                torch.zeros(channels, device="cuda"), torch.ones(channels, device="cuda"))

    weight, bias, mean, var = parameters()
    ours = lambda x: sync_batch_norm(x, mean, var, weight, bias, 0.1, 1e-5, group, 1)  # noqa: E731
    t_weight, t_bias, t_mean, t_var = parameters()
    theirs = lambda x: TorchSync.apply(x, t_weight, t_bias, t_mean, t_var, 1e-5, 0.1, group, 1)  # noqa: E731
    return ours, theirs


def _modules(channels):
    from .. import nn

    return nn.SyncBatchNorm(channels).cuda(), torch.nn.SyncBatchNorm(channels).cuda()


def run(quick: bool = False) -> list[Row]:
    import torch.distributed as dist

    require_gpu()
    made = _one_rank_group()
    try:
        return _rows(quick, dist.group.WORLD)
    finally:
        if made:
            dist.destroy_process_group()


def _rows(quick, group) -> list[Row]:
    rows = []
    for channels, side in RESNET50_SHAPES[:3] if quick else RESNET50_SHAPES:
        for dtype in DTYPES:
            x = torch.randn(BATCH, channels, side, side, device="cuda", dtype=dtype).requires_grad_()
            dy = torch.randn_like(x)
            for way, (ours, theirs) in (("collectives", _collectives(group, channels)),
                                        ("module", _modules(channels))):
                ours_ms = time_ms(_step(ours, x, dy), graph=False)
                torch_ms = time_ms(_step(theirs, x, dy), graph=False)
                rows.append(Row("sync_batch_norm", f"{way} B{BATCH} C{channels} {side}x{side}",
                                str(dtype).replace("torch.", ""), "forward+backward", ours_ms, torch_ms,
                                8 * x.numel() * x.element_size(), "TB/s", {}))
    return rows
