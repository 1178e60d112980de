"""CUDA graphs: each functional op, forward and backward (and batch norm's running-statistics update),
captured in one CUDA graph and replayed gives the results the same op gives run eagerly.

The usual recipe: warm up on a side stream (this compiles the kernels and tunes their block sizes,
which must not happen inside a capture), capture one step, then for two fresh sets of inputs copied
into the static tensors, replay and compare every output bitwise with an eager step on the same
inputs (the kernels are deterministic, see test_determinism.py). A host synchronisation or a
non-graph-safe call inside an op makes the capture itself fail. Eager results are also held to
PyTorch in float64, so a replay that repeats stale outputs cannot pass.
"""
import pytest
import torch
import torch.nn.functional as F
from support import TOLERANCE, assert_close, gpu

from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d

DEVICE = "cuda"
CASES = {
    # name: (op, x shape, parameter shapes, options, dtype)
    "conv2d-channels-last": ("conv2d", (4, 32, 16, 16), [(32, 32, 3, 3), (32,)], dict(padding=1), torch.float32),
    "conv2d-nchw-strided": ("conv2d", (4, 12, 17, 15), [(20, 12, 3, 3), (20,)], dict(stride=2, padding=1),
                            torch.bfloat16),
    "conv2d-pointwise": ("conv2d", (4, 24, 9, 11), [(40, 24, 1, 1), (40,)], {}, torch.bfloat16),
    "conv2d-pointwise-strided": ("conv2d", (4, 24, 9, 11), [(40, 24, 1, 1), (40,)], dict(stride=2), torch.bfloat16),
    "conv2d-channels-last-strided": ("conv2d", (4, 32, 15, 13), [(32, 32, 3, 3), (32,)], dict(stride=2, padding=1),
                                     torch.float32),
    "conv2d-depthwise": ("conv2d", (4, 24, 16, 16), [(24, 1, 3, 3), (24,)], dict(padding=1, groups=24),
                         torch.float16),
    "avg_pool2d": ("avg_pool2d", (4, 16, 15, 17), [], dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
                   torch.bfloat16),
    "batch_norm-train": ("batch_norm", (8, 16, 20, 20), [(16,), (16,)], dict(training=True), torch.float32),
    "batch_norm-train-split": ("batch_norm", (32, 8, 48, 48), [(8,), (8,)], dict(training=True), torch.bfloat16),
    "batch_norm-eval": ("batch_norm", (8, 16, 20, 20), [(16,), (16,)], dict(training=False), torch.float16),
}


def reference(op, x, params, options, stats):
    """PyTorch in float64 on the CPU: [y, grads...] for the gradient `dy`, given as stats[-1]."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in [x] + params]
    if op == "conv2d":
        y = F.conv2d(*leaves, **options)
    elif op == "avg_pool2d":
        y = F.avg_pool2d(leaves[0], **options)
    else:
        running = [s.detach().cpu().double() for s in stats[:2]]
        y = F.batch_norm(leaves[0], *running, *leaves[1:], momentum=0.1, eps=1e-5, **options)
    grads = torch.autograd.grad(y, leaves, stats[-1].cpu().double())
    return [y] + list(grads)


@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_capture_and_replay_equals_eager(name):
    op, x_shape, param_shapes, options, dtype = CASES[name]
    param_dtype = torch.float32 if op == "batch_norm" else dtype
    x = torch.randn(x_shape, device=DEVICE, dtype=dtype, requires_grad=True)
    params = [torch.randn(s, device=DEVICE, dtype=param_dtype, requires_grad=True) for s in param_shapes]
    C = x_shape[1]
    running_mean = torch.zeros(C, device=DEVICE)
    running_var = torch.ones(C, device=DEVICE)

    def step():
        if op == "conv2d":
            y = conv2d(x, *params, **options)
        elif op == "avg_pool2d":
            y = avg_pool2d(x, **options)
        else:
            y = batch_norm(x, running_mean, running_var, *params, momentum=0.1, eps=1e-5, **options)
        grads = torch.autograd.grad(y, [x] + params, dy)
        return [y] + list(grads)

    with torch.no_grad():
        dy = torch.randn(step_output_shape(op, x, params, options), device=DEVICE, dtype=dtype)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for trial in range(2):
        fresh = [torch.randn_like(t) for t in [x] + params + [dy]]
        start_stats = torch.randn(C, device=DEVICE) * 0.1, torch.rand(C, device=DEVICE) + 0.5
        with torch.no_grad():
            for static, new in zip([x] + params + [dy], fresh):
                static.copy_(new)
            running_mean.copy_(start_stats[0])
            running_var.copy_(start_stats[1])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured] + [running_mean.clone(), running_var.clone()]

        with torch.no_grad():
            running_mean.copy_(start_stats[0])
            running_var.copy_(start_stats[1])
        eager = step() + [running_mean.clone(), running_var.clone()]
        torch.cuda.synchronize()

        names = ["y", "dx"] + [f"dparam{i}" for i in range(len(params))] + ["running_mean", "running_var"]
        for what, got, want in zip(names, replayed, eager):
            assert torch.equal(got, want), f"trial {trial}, {what}: replay differs from eager"
        refs = reference(op, x, params, options, list(start_stats) + [dy])
        tol = 2e-3 if dtype == torch.float32 and op == "conv2d" else TOLERANCE[dtype]  # TF32 for fp32 conv
        for what, got, want in zip(names, eager, refs):
            assert_close(got, want, tol=tol)


def step_output_shape(op, x, params, options):
    """The output shape of one step, from a run with gradients off (not captured, nothing saved)."""
    if op == "conv2d":
        return conv2d(x, *params, **options).shape
    if op == "avg_pool2d":
        return avg_pool2d(x, **options).shape
    return x.shape
