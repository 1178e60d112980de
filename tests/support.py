"""What every test shares: the device the suite runs on, poisoned outputs, float64 references."""
import pytest
import torch
import torch.nn.functional as F

from nnkernels.kernel import INTERPRETED
from nnkernels.machine import Machine

# Interpreted processes run the kernels on CPU tensors; compiled ones on the GPU.
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error (||out - ref|| / ||ref||) allowed per element type.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
# fp32 products as three bf16 products of split values (`ops/common/tensor_core.bf16x3_dot`, the TF32 path of
# kernels whose tiles TF32 tensor cores cannot read): each product within about 3e-5 of its value
# (2^-16 for the dropped lo*lo, 2^-17 for each rounded lo), 4.5e-6 of the norm over long random sums.
BF16X3_TOLERANCE = 1e-4
# fp32 convolutions with TF32 allowed (PyTorch's default): TF32 products on the GPU, and in the interpreter
# too where a kernel rounds its operands to TF32 itself (the 1x1 kernels, `tf32_rounded`); 3e-4 to 5e-4 of
# the norm over random data.
CONV_TF32_TOLERANCE = 2e-3
# The machine whose candidate lists the `gpu_lists` fixture gives every op: an H200's 132 SMs, with a TMA unit.
GPU = Machine(gpu=True, sms=132, tma=True, name="test GPU")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")


def randn(*shape, dtype=torch.float32, generator=None):
    """Fresh random data (never zeros), made in float32 on the CPU and moved to the suite's device."""
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


def poisoned(*shape, dtype=torch.float32):
    """An output buffer full of NaN, so an element the kernel does not write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close(out, ref, dtype=None, tol=None, floor=0.0):
    """||out - ref|| / max(||ref||, floor) within the tolerance of `dtype` (or `tol`); no NaN anywhere.

    `floor` is for sums whose terms can cancel: rounding grows with the terms' magnitudes, not with the
    sum, so a one-channel bias gradient of 70 random terms that lands on 0.04 is judged on the scale of
    its terms (the sum of their magnitudes), not on 0.04.
    """
    tol = tol if tol is not None else TOLERANCE[dtype or out.dtype]
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(out64).any(), f"{int(torch.isnan(out64).sum())} elements unwritten or NaN"
    err = (out64 - ref64).norm().item() / (max(ref64.norm().item(), floor) or 1.0)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"



def assert_conv2d_matches_float64(y, grads, leaves, dy, options, dtype):
    """y = conv2d(*leaves, *options) (leaves: x, weight and the bias where there is one) and `grads`, its gradients
    for `dy`, within `dtype`'s tolerance of torch's convolution and autograd in float64 on the same data (the
    gradients judged on the scale of their terms: sums of many can cancel)."""
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref_y = F.conv2d(*ref_leaves[:2], ref_leaves[2] if len(ref_leaves) > 2 else None, *options)
    ref_grads = torch.autograd.grad(ref_y, ref_leaves, dy.double().cpu())
    assert_close(y, ref_y, dtype)
    for grad, ref in zip(grads, ref_grads):
        assert_close(grad, ref, dtype, floor=ref.abs().sum().item() / ref.numel() ** 0.5)


def conv_output_sizes(sizes, kernel, stride, padding, dilation):
    """A convolution's output sizes for input `sizes` (H, W), each as torch computes it:
    (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1."""
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, s, p, d in zip(sizes, kernel, stride, padding, dilation))


def depthwise_conv2d_float64(x, w, bias, dy, stride, padding, dilation):
    """torch's depthwise convolution (groups = C) of x, w and bias (or None) in float64 on the CPU, and its
    gradients for dy: (y, dx, dw, dbias), dbias None without a bias."""
    x64, w64 = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    b64 = bias.double().cpu().requires_grad_() if bias is not None else None
    y64 = F.conv2d(x64, w64, b64, stride, padding, dilation, x.shape[1])
    y64.backward(dy.double().cpu())
    return y64, x64.grad, w64.grad, None if b64 is None else b64.grad


def reduce_depthwise_dw(partial, split, C, KH, KW, has_bias, dtype):
    """dw [C, 1, KH, KW] and dbias [C], poisoned, then written by the dw reduce (one tap, 8 split rows and 16
    positions a program) of the `split` fp32 partial rows a depthwise dw kernel left in `partial`."""
    from nnkernels.ops.conv2d.partials import Conv2dDwReduce

    dw, dbias = poisoned(C, 1, KH, KW, dtype=dtype), poisoned(C, dtype=dtype)
    Conv2dDwReduce(has_bias, 1, 1, 8, 16, dtype=dtype).launch(partial, dw, dbias if has_bias else dw, split,
                                                              dw.numel(), C)
    return dw, dbias


# Relative tolerance of batch norm's fp32 per-channel results (statistics, dweight, dbias), from any input dtype.
BN_STATS_TOLERANCE = 2e-5


def batch_norm_train_ops_match(x, weight, bias, dy, references, dtype):
    """nnkernels' training batch-norm forward and backward operators on (x, weight, bias, dy) within `dtype`'s
    tolerance of float64 `references` (y, dx, dweight, dbias), the batch mean and unbiased variance too; returns
    (y, dx) and the kernel ids the two passes launched."""
    from nnkernels.functional import batchnorm, last_kernels

    y64, dx64, dw64, db64 = references
    y, mean, rstd, var_unbiased = batchnorm.batch_norm_train_op(x, weight, bias, 1e-5)
    dx, dweight, dbias = batchnorm.batch_norm_train_backward_op(dy, x, weight, mean, rstd)
    assert_close(mean, x.double().mean((0, 2, 3)), tol=BN_STATS_TOLERANCE)
    assert_close(var_unbiased, x.double().var((0, 2, 3), unbiased=True), tol=BN_STATS_TOLERANCE)
    assert_close(y, y64, dtype)
    assert_close(dx, dx64, dtype)
    assert_close(dweight, dw64, tol=BN_STATS_TOLERANCE)
    assert_close(dbias, db64, tol=BN_STATS_TOLERANCE)
    launched = last_kernels("batch_norm")
    return (y, dx), tuple(launched["train_forward"] + launched["train_backward"])

def dtype_id(dtype) -> str:
    """Readable test ids: fp32, fp16, bf16."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def force_choice(monkeypatch, index, offered=None):
    """Every op's tuning answers with candidate `index` of its list (the last one where the list is shorter; or,
    `index` a function, the candidate `index(list)` returns), on plans built afresh; `offered`, a dict, collects
    each kind's list."""
    from nnkernels import tuning
    from nnkernels.functional import clear_plans

    def pick(kind, key, candidates, run, decode):
        listed = candidates()
        if offered is not None:
            offered[kind] = listed
        return index(listed) if callable(index) else listed[min(index, len(listed) - 1)]

    monkeypatch.setattr(tuning, "choose", pick)
    clear_plans()


def allocations_by_the_ops(monkeypatch, allocate):
    """Route the allocations nnkernels' functional ops make with `torch.empty`, `torch.empty_like` and
    `Tensor.new_empty` through `allocate(shape, dtype, device)` (only theirs: Triton's interpreter allocates
    through the same functions for its own bookkeeping); a `memory_format` asked of `torch.empty` is kept."""
    import sys

    def by_the_ops(original, shape_of, keeps_format=False):
        def allocation(*args, **kwargs):
            if not sys._getframe(1).f_globals.get("__name__", "").startswith("nnkernels.functional"):
                return original(*args, **kwargs)
            shape, dtype, device = shape_of(*args, **kwargs)
            out = allocate(shape, dtype or torch.get_default_dtype(), device)
            memory_format = kwargs.get("memory_format") if keeps_format else None
            return out if memory_format is None else out.contiguous(memory_format=memory_format)
        return allocation

    def empty(*size, dtype=None, device=None, **_ignored):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        return tuple(size), dtype, device

    monkeypatch.setattr(torch, "empty", by_the_ops(torch.empty, empty, keeps_format=True))
    monkeypatch.setattr(torch, "empty_like", by_the_ops(
        torch.empty_like, lambda t, *, dtype=None, device=None, **_: (tuple(t.shape), dtype or t.dtype,
                                                                       device or t.device)))
    monkeypatch.setattr(torch.Tensor, "new_empty", by_the_ops(
        torch.Tensor.new_empty, lambda t, *size, dtype=None, device=None, **_: (
            empty(*size)[0], dtype or t.dtype, device or t.device)))
