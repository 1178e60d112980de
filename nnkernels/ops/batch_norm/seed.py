"""The seed's NCHW batch-norm kernels with frozen statistics (inference):
`BatchNorm2dNchwForwardInference` and `BatchNorm2dNchwBackward`.

rstd[c] = 1 / sqrt(running_var[c] + eps), computed in fp32 in both kernels.
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_numel


def batch_norm_stats_check(a):
    """Check the per-channel tensors and eps of a frozen-statistics launch."""
    for name in ("weight", "bias", "running_mean", "running_var", "dweight", "dbias"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.C, "C")
    if not a.eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {a.eps}")


def batch_norm_forward_inference_entry(k, a):
    """Check the launch; the grid is [C, B] with B = numel(x) / (C*HW)."""
    batch_norm_stats_check(a)
    if a.x.numel() % (a.C * a.HW) or a.x.numel() == 0:
        raise ValueError(f"x: expected a positive multiple of C*HW = {a.C * a.HW} elements, got {a.x.numel()}")
    batch = a.x.numel() // (a.C * a.HW)
    check_numel("y", a.y, a.x.numel(), "numel(x)")
    if batch > 65535:
        raise ValueError(f"x: the batch {batch} exceeds the 65535 that the grid's second axis holds")
    return (a.C, batch)


def batch_norm_backward_entry(k, a):
    """Check the launch; the grid is [C]."""
    batch_norm_stats_check(a)
    for name in ("dy", "x", "dx"):
        check_numel(name, getattr(a, name), a.B * a.C * a.HW, "B*C*HW")
    return (a.C,)


@triton.jit
def batch_norm2d_nchw_forward_inference(
    x, y, weight, bias, running_mean, running_var, C, HW, eps, BLOCK_HW: tl.constexpr,
):
    """NCHW batch norm forward with frozen statistics.

    Grid: [C, B]. Program (c, b) writes the HW elements of y[b, c], BLOCK_HW at a time:
        y = weight[c] * (x - running_mean[c]) * rstd[c] + bias[c],  rstd = 1 / sqrt(running_var[c] + eps).
    In fp32; every element of y is written.
    """
    c = tl.program_id(0)
    b = tl.program_id(1)
    rstd = 1.0 / tl.sqrt(tl.load(running_var + c).to(tl.float32) + eps)
    scale = tl.load(weight + c).to(tl.float32) * rstd
    shift = tl.load(bias + c).to(tl.float32) - tl.load(running_mean + c).to(tl.float32) * scale
    plane = (b.to(tl.int64) * C + c) * HW
    for start in range(0, HW, BLOCK_HW):
        hw = start + tl.arange(0, BLOCK_HW)
        in_plane = hw < HW
        xv = tl.load(x + plane + hw, mask=in_plane, other=0.0).to(tl.float32)
        tl.store(y + plane + hw, (xv * scale + shift).to(y.dtype.element_ty), mask=in_plane)


BatchNorm2dNchwForwardInference = kernel_object(
    batch_norm2d_nchw_forward_inference,
    example=(1024,),
    entry=batch_norm_forward_inference_entry,
    floats=("eps",),
    seed=True,
)


@triton.jit
def batch_norm2d_nchw_backward(
    dy, x, dx, weight, running_mean, running_var, dweight, dbias, B, C, HW, eps, BLOCK_HW: tl.constexpr,
):
    """NCHW batch norm backward with frozen statistics (the inference case).

    Grid: [C]. Program c loops over b and over HW in blocks of BLOCK_HW elements, and writes
        dx[b, c, hw] = weight[c] * rstd[c] * dy[b, c, hw]
        dweight[c]   = sum over (b, hw) of dy * xhat,  xhat = (x - running_mean[c]) * rstd[c]
        dbias[c]     = sum over (b, hw) of dy
    with rstd = 1 / sqrt(running_var[c] + eps). Sums in fp32; every output is written (no zero-init).
    """
    c = tl.program_id(0)
    mean = tl.load(running_mean + c).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.load(running_var + c).to(tl.float32) + eps)
    dx_scale = tl.load(weight + c).to(tl.float32) * rstd
    sum_dy = tl.zeros([BLOCK_HW], dtype=tl.float32)
    sum_dy_xhat = tl.zeros([BLOCK_HW], dtype=tl.float32)
    for b in range(0, B):
        plane = (b * C + c).to(tl.int64) * HW
        for start in range(0, HW, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            in_plane = hw < HW
            dyv = tl.load(dy + plane + hw, mask=in_plane, other=0.0).to(tl.float32)
            xv = tl.load(x + plane + hw, mask=in_plane, other=0.0).to(tl.float32)
            tl.store(dx + plane + hw, (dyv * dx_scale).to(dx.dtype.element_ty), mask=in_plane)
            sum_dy += dyv
            sum_dy_xhat += dyv * (xv - mean) * rstd
    tl.store(dweight + c, tl.sum(sum_dy_xhat, axis=0).to(dweight.dtype.element_ty))
    tl.store(dbias + c, tl.sum(sum_dy, axis=0).to(dbias.dtype.element_ty))


BatchNorm2dNchwBackward = kernel_object(
    batch_norm2d_nchw_backward,
    example=(1024,),
    entry=batch_norm_backward_entry,
    floats=("eps",),
    seed=True,
)
