"""The seed's 2-D average-pooling kernels, as specified: `Avgpool2dForward` and `Avgpool2dBackward`.

No padding: windows lie inside the image, OH = (H - kh) // stride_h + 1, divisor kh*kw.
The backward scatters with atomics and needs dx zero-initialised.
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid, check_numel, check_output_size
from ..common.host_math import cdiv
from ..common.tiles import seed_row_tile


def avg_pool2d_entry(k, a):
    """Check a seed pooling launch (forward or backward) and return its flat grid over output rows."""
    check_output_size("OH", a.OH, a.H, k.kh, k.stride_h, 0, "H", "kh", "stride_h", "padding")
    check_output_size("OW", a.OW, a.W, k.kw, k.stride_w, 0, "W", "kw", "stride_w", "padding")
    for name in ("x", "dx"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.C * a.H * a.W, "B*C*H*W")
    for name in ("y", "dy"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), a.B * a.C * a.OH * a.OW, "B*C*OH*OW")
    return check_grid(a.B * a.C * a.OH * cdiv(a.OW, k.block_ow))


@triton.jit
def avgpool2d_forward(
    x, y, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, BLOCK_OW: tl.constexpr,
):
    """2-D average pooling forward.

    Grid: pid = ((b * C + c) * OH + oh) * num_ow_tiles + ow_tile.
    One program writes y[b, c, oh, ow] for the BLOCK_OW columns ow of its tile:
        y = (1 / (KH*KW)) * sum over (kh, kw) of x[b, c, oh*STRIDE_H + kh, ow*STRIDE_W + kw].
    Accumulates in fp32; every element of y is written.
    """
    plane, oh, ow, ow_in_range = seed_row_tile(OH, OW, BLOCK_OW)
    x_plane = x + plane.to(tl.int64) * H * W
    acc = tl.zeros([BLOCK_OW], dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            xv = tl.load(x_plane + (oh * STRIDE_H + kh) * W + ow * STRIDE_W + kw, mask=ow_in_range, other=0.0)
            acc += xv.to(tl.float32)
    y_row = y + (plane.to(tl.int64) * OH + oh) * OW
    tl.store(y_row + ow, (acc / (KH * KW)).to(y.dtype.element_ty), mask=ow_in_range)


Avgpool2dForward = kernel_object(
    avgpool2d_forward,
    example=(2, 2, 2, 2, 64),
    entry=avg_pool2d_entry,
    seed=True,
    helpers=(seed_row_tile,),
)


@triton.jit
def avgpool2d_backward(
    dy, dx, B, C, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, BLOCK_OW: tl.constexpr,
):
    """2-D average pooling backward, atomic scatter on the forward's grid.

    Grid: pid = ((b * C + c) * OH + oh) * num_ow_tiles + ow_tile.
    For each dy[b, c, oh, ow] of its tile, one program spreads dy / (KH*KW) over the window:
        atomic_add(dx[b, c, oh*STRIDE_H + kh, ow*STRIDE_W + kw], dy / (KH*KW)) for every (kh, kw),
    so overlapping windows (stride < kernel) add up. Contract: dx must be zero-initialised before launch.
    """
    plane, oh, ow, ow_in_range = seed_row_tile(OH, OW, BLOCK_OW)
    dy_row = dy + (plane.to(tl.int64) * OH + oh) * OW
    share = (tl.load(dy_row + ow, mask=ow_in_range, other=0.0).to(tl.float32) / (KH * KW)).to(dx.dtype.element_ty)
    dx_plane = dx + plane.to(tl.int64) * H * W
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            tl.atomic_add(dx_plane + (oh * STRIDE_H + kh) * W + ow * STRIDE_W + kw, share, mask=ow_in_range)


Avgpool2dBackward = kernel_object(
    avgpool2d_backward,
    example=(2, 2, 2, 2, 64),
    entry=avg_pool2d_entry,
    seed=True,
    helpers=(seed_row_tile,),
)
