"""`sync_batch_norm`: batch norm in training mode with the batch statistics of every rank of a process group,
as `torch.nn.SyncBatchNorm` computes them, on nnkernels' kernels.

Forward, on each rank (x viewed as [B, C, HW], M = B*HW values per channel):
1. one all-gather of a header [status, C, dtype, M] (int64, the same size on every rank): every rank sees every
   rank's channel count, dtype and count, and every rank raises the same error where they disagree or a rank's
   own checks failed, rather than hang in a collective of mismatched sizes;
2. the per-channel partials of the split statistics kernel (count, mean of x - x[0, c, 0], M2), merged to one
   per channel where the channel was cut into chunks (`BatchNorm2dMergePartialStats`), with their shift
   x[0, c, 0], and one all-gather of those [4, C] rows: ranks may hold different batch sizes, and a rank with
   B = 0 sends a count of 0, which adds nothing;
3. `BatchNorm2dSyncStats` merges the ranks' partials (Chan's formula; the sum-of-squares form would lose the
   variance to cancellation where |mean| >> std) into the mean, the biased variance and rstd over the N values
   of every rank, and updates the running statistics in place as torch does (momentum, unbiased M2 / (N - 1));
4. the normalising kernel: y = (x - mean) * weight * rstd + bias (the evaluation kernel given the batch
   statistics).
Backward: the local sums of dy and dy * (x - mean) (split kernel), one all-reduce of them, then the elementwise
dx kernel with the global count N. dweight and dbias are this rank's own sums, as torch's SyncBatchNorm returns
them (DistributedDataParallel averages gradients itself); a rank with B = 0 gets none (zeros), and still joins
the all-reduce. As in torch, the all-reduce runs only where x needs its gradient, which every rank must agree on.

The header costs a second collective in the forward and a device-to-host copy (torch's SyncBatchNorm makes one
too, to drop empty ranks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import machine
from ..launcher import Launcher
from ..ops.batch_norm.sync import BatchNorm2dMergePartialStats, BatchNorm2dSyncStats
from ..ops.common.host_math import next_power_of_2
from . import batchnorm
from .batchnorm_algorithms import (F32, BatchNormProblem, split_candidates, sync_backward_runners,
                                   sync_statistics_runner)
from .common import (FLOAT_DTYPES, ArgumentError, PlanCache, aligned, fp32_rows_length, kernel,
                     refuse_double_backward, register_kernels)

_PLANS = PlanCache()
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_FAILED = 1  # header status: this rank's own checks failed


def _check(x, weight, bias, running_mean, running_var, momentum, eps):
    """This rank's own checks; ArgumentError/TypeError naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2 or x.shape[1] == 0:
        raise ArgumentError(f"x: expected at least 2 dimensions (B, C, ...) and C > 0, got shape {tuple(x.shape)}")
    if any(size == 0 for size in x.shape[2:]):
        raise ArgumentError(f"x: expected non-empty spatial sizes (the batch may be 0), got {tuple(x.shape)}")
    if x.shape[0] > 0:  # the rest as batch_norm checks it; its plan's signature wants a non-empty batch
        batchnorm._check(x, running_mean, running_var, weight, bias, True, momentum, eps)
        return
    for name, tensor in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                         ("running_var", running_var)):
        if tensor is not None and (not isinstance(tensor, torch.Tensor) or tensor.shape != (x.shape[1],)):
            raise ArgumentError(f"{name}: expected None or a tensor of shape ({x.shape[1]},), got "
                                f"{tuple(getattr(tensor, 'shape', ())) or tensor!r}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ArgumentError(f"eps: expected a float > 0 in training, got {eps!r}")


def _all_gather(tensor, group, world_size):
    """[world_size, *tensor.shape]: every rank's `tensor`, in rank order."""
    gathered = tensor.new_empty(world_size, *tensor.shape)
    if dist.get_backend(group) == "gloo":  # gloo takes the list form on every torch version
        dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
    else:
        dist.all_gather_into_tensor(gathered, tensor, group=group)
    return gathered


def _header_device(x, group):
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.device
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _agree(header, group, world_size, own_error):
    """Exchange the headers; raise on every rank where a rank failed its checks or the ranks disagree."""
    headers = _all_gather(header, group, world_size).tolist()
    if own_error is not None:
        raise own_error
    failed = [r for r, (status, *_rest) in enumerate(headers) if status == _FAILED]
    if failed:
        raise RuntimeError(f"sync_batch_norm: rank(s) {failed} rejected their input (their own error says why); "
                           "no rank normalised this batch")
    channels = [h[1] for h in headers]
    if len(set(channels)) > 1:
        raise ArgumentError(f"x: the ranks disagree on the channel count (dim 1): {channels} on ranks "
                            f"0..{world_size - 1}")
    dtypes = [_DTYPES[h[2]] for h in headers]
    if len(set(dtypes)) > 1:
        raise TypeError(f"x: the ranks disagree on the dtype: {[str(d) for d in dtypes]} on ranks 0..{world_size - 1}")
    counts = [h[3] for h in headers]
    total = sum(counts)
    if total == 1:
        raise ArgumentError(f"x: Expected more than 1 value per channel when training, got 1 over the {world_size} "
                            f"ranks (per rank {counts})")
    return total


class SyncBatchNormPlan:
    """The kernels of one signature (x's shape, dtype and device, the number of ranks)."""

    def __init__(self, x, world_size):
        B, C = x.shape[0], x.shape[1]
        self.C, self.world_size, self.row = C, world_size, fp32_rows_length(C)
        self.count = B * (x.numel() // (B * C)) if B else 0
        self.device = x.device
        block = next_power_of_2(world_size)
        self.sync_stats = {update: Launcher(kernel(BatchNorm2dSyncStats, block, update, dtype=F32))
                           for update in (False, True)}
        if B == 0:
            return
        problem = BatchNormProblem(x.shape, x.dtype, x.device, machine.machine_of(x.device))
        # The first guesses, untuned: a pass between two collectives is timed best in the step it runs in.
        forward, backward = (split_candidates(step, problem.machine)[0] for step in ("train_forward", "train_backward"))
        self.statistics, self.chunks = sync_statistics_runner(problem, forward)
        self.sums, self.dx = sync_backward_runners(problem, backward)
        self.width = fp32_rows_length(C * self.chunks)
        if self.chunks > 1:
            self.merge = Launcher(kernel(BatchNorm2dMergePartialStats, next_power_of_2(self.chunks), dtype=F32))

    def local_partials(self, x):
        """[4, row] fp32: this rank's count, mean (of x - shift), M2 and shift per channel."""
        C, row = self.C, self.row
        if self.count == 0:
            return torch.zeros(4, row, dtype=F32, device=self.device)
        shift = x.view(x.shape[0], C, -1)[0, :, 0]
        if self.chunks == 1:
            partials = torch.empty(4, row, dtype=F32, device=self.device)
            self.statistics(x, partials)
            partials[3, :C].copy_(shift)
            return partials
        chunked = torch.empty(4, self.width, dtype=F32, device=self.device)
        self.statistics(x, chunked)
        chunked[3, :C * self.chunks].view(self.chunks, C).copy_(shift)  # each chunk's shift: [chunks, C]
        merged = torch.empty(4, row, dtype=F32, device=self.device)
        self.merge(chunked, merged, C, self.chunks, self.width, self.chunks, 1, C, row)
        return merged

    def global_stats(self, gathered, running_mean, running_var, momentum, eps):
        """[3, C] fp32 (rows 16-byte aligned): mean, biased variance and rstd over every rank; the running
        statistics updated in place if given."""
        C, row = self.C, self.row
        stats = torch.empty(3, row, dtype=F32, device=self.device)
        update = running_mean is not None
        running = (running_mean, running_var) if update else (stats[0], stats[1])  # not touched without an update
        self.sync_stats[update](gathered, stats, *running, C, self.world_size, row, 1, 4 * row, 4 * row, row, eps,
                                momentum)
        return stats[:, :C]


def _plan(x, world_size):
    signature = (x.shape, x.dtype, x.device, world_size)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.build(signature, lambda: SyncBatchNormPlan(x, world_size))
    return plan


def _ready(x):
    return aligned(x if x.is_contiguous() else x.contiguous())


class _SyncTrain(torch.autograd.Function):
    """The forward and backward of the module docstring; the running statistics (a tuple) updated in place."""

    @staticmethod
    def forward(ctx, x, weight, bias, running, momentum, eps, group, world_size):
        running_mean, running_var = running
        own_error = None
        try:
            _check(x, weight, bias, running_mean, running_var, momentum, eps)
        except (TypeError, ValueError, RuntimeError) as error:
            own_error = error
        header = [_FAILED, 0, 0, 0] if own_error is not None else [
            0, x.shape[1], _DTYPE_CODES[x.dtype], x.numel() // x.shape[1]]
        total = _agree(torch.tensor(header, dtype=torch.int64).to(_header_device(x, group)), group, world_size,
                       own_error)
        if total == 0:  # every rank empty: nothing to normalise, no statistics, as batch_norm does
            ctx.empty = True
            return x.clone()
        x = _ready(x)
        plan = _plan(x, world_size)
        gathered = _all_gather(plan.local_partials(x), group, world_size)
        stats = plan.global_stats(gathered, running_mean, running_var, float(momentum), float(eps))
        mean, var, rstd = stats.unbind(0)
        ctx.plan, ctx.group, ctx.world_size, ctx.empty, ctx.total = plan, group, world_size, False, total
        ctx.param_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        if plan.count == 0:
            ctx.save_for_backward(x, None, mean, rstd)
            return torch.empty_like(x)
        normalise = batchnorm._plan(x, weight, bias, mean, var, False)
        weight32, bias32 = normalise.params(weight, bias)
        ctx.save_for_backward(x, weight32, mean, rstd)
        return normalise.run("eval_forward", x, weight32, bias32, mean, var, float(eps))

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("sync_batch_norm")
        if ctx.empty:
            return (None,) * 8
        x, weight32, mean, rstd = ctx.saved_tensors
        plan = ctx.plan
        C = plan.C
        dx = dweight = dbias = None
        if plan.count == 0:
            sums = torch.zeros(2, plan.row, dtype=F32, device=x.device)
        else:
            sums = torch.empty(2, plan.row, dtype=F32, device=x.device)
            plan.sums(_ready(dy), x, mean, sums)
            weight_dtype, bias_dtype = ctx.param_dtypes
            if weight_dtype is not None and ctx.needs_input_grad[1]:
                dweight = (sums[1, :C] * rstd).to(weight_dtype)
            if bias_dtype is not None and ctx.needs_input_grad[2]:
                dbias = sums[0, :C].to(bias_dtype, copy=True)
        if ctx.needs_input_grad[0]:
            dist.all_reduce(sums, group=ctx.group)
            if plan.count > 0:
                sums.mul_(plan.count / ctx.total)  # the dx kernel divides by this rank's count
                dx = plan.dx(_ready(dy), x, weight32, mean, rstd, sums)
        return dx, dweight, dbias, None, None, None, None, None


@torch.compiler.disable
def sync_batch_norm(x, running_mean, running_var, weight=None, bias=None, momentum=0.1, eps=1e-5, group=None,
                    world_size=None):
    """Training-mode batch norm of x (B, C, ...) with the statistics of every rank of `group` (default: the
    world), as `torch.nn.SyncBatchNorm` computes them; every rank of the group must call it, in the same order.

    running_mean and running_var: (C,) float32 updated in place with the unbiased variance over all ranks'
    values, or both None; weight and bias: (C,) or None; B may differ between ranks and be 0 on some. Bad
    arguments, and ranks that disagree on C or dtype, raise on every rank. Not traced by torch.compile (its
    collectives take a ProcessGroup): `nnkernels.nn.SyncBatchNorm` runs it outside the graph."""
    if (running_mean is None) != (running_var is None):
        raise ArgumentError("running_mean, running_var: expected both or neither, got only one")
    if momentum is None:
        raise TypeError("momentum: expected a float; for a cumulative average pass 1 / num_batches_tracked")
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
        raise TypeError(f"momentum: expected a float, got {momentum!r}")
    if group is None:
        group = dist.group.WORLD
    if world_size is None:
        world_size = dist.get_world_size(group)
    return _SyncTrain.apply(x, weight, bias, (running_mean, running_var), momentum, eps, group, world_size)


# It also launches batch norm's split statistics, backward sums and normalising kernels (listed under batch_norm).
register_kernels("sync_batch_norm", (BatchNorm2dMergePartialStats, BatchNorm2dSyncStats))
