"""The seed's 2-D convolution kernels, as specified: `Conv2dForward` and `Conv2dBackward`.

Both use the seed's flat grid over output rows, one program per `block_ow` outputs of a row.
They are the contract people port code against, not the fast path: the backward scatters
with atomics (non-deterministic order of fp additions) and needs dx and dw zero-initialised.
"""
import triton
import triton.language as tl

from ...kernel import kernel_object
from ..common.checks import check_grid, check_numel, check_output_size
from ..common.host_math import cdiv
from ..common.tiles import seed_row_tile


def conv2d_entry(k, a):
    """Check a seed conv launch (forward or backward) and return its flat grid over output rows."""
    if a.C_IN % k.g:
        raise ValueError(f"C_IN: expected a multiple of g = {k.g}, got {a.C_IN}")
    if a.C_OUT % k.g:
        raise ValueError(f"C_OUT: expected a multiple of g = {k.g}, got {a.C_OUT}")
    check_output_size("OH", a.OH, a.H, k.kh, k.stride_h, k.pad_h, "H", "kh", "stride_h", "pad_h")
    check_output_size("OW", a.OW, a.W, k.kw, k.stride_w, k.pad_w, "W", "kw", "stride_w", "pad_w")
    x_numel = a.B * a.C_IN * a.H * a.W
    w_numel = a.C_OUT * (a.C_IN // k.g) * k.kh * k.kw
    y_numel = a.B * a.C_OUT * a.OH * a.OW
    for name in ("x", "dx"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), x_numel, "B*C_IN*H*W")
    for name in ("w", "dw"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), w_numel, "C_OUT*(C_IN/g)*kh*kw")
    for name in ("y", "dy"):
        if hasattr(a, name):
            check_numel(name, getattr(a, name), y_numel, "B*C_OUT*OH*OW")
    return check_grid(a.B * a.C_OUT * a.OH * cdiv(a.OW, k.block_ow))


@triton.jit
def conv2d_forward(
    x, w, y, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, G: tl.constexpr, BLOCK_OW: tl.constexpr,
):
    """2-D convolution forward, direct.

    Grid: pid = ((b * C_OUT + c_out) * OH + oh) * num_ow_tiles + ow_tile.
    One program writes y[b, c_out, oh, ow] for the BLOCK_OW columns ow of its tile:
        y = sum over (c_in_local, kh, kw) of x[b, c_in, oh*STRIDE_H - PAD_H + kh, ow*STRIDE_W - PAD_W + kw]
            * w[c_out, c_in_local, kh, kw],  c_in = (c_out // (C_OUT/G)) * (C_IN/G) + c_in_local,
    with x read as 0 outside the image. Accumulates in fp32; every element of y is written.
    """
    y_plane, oh, ow, ow_in_range = seed_row_tile(OH, OW, BLOCK_OW)
    c_out = y_plane % C_OUT
    b = y_plane // C_OUT
    cin_per_group = C_IN // G
    c_in_first = (c_out // (C_OUT // G)) * cin_per_group
    acc = tl.zeros([BLOCK_OW], dtype=tl.float32)
    for c_in_local in range(0, cin_per_group):
        x_plane = x + (b.to(tl.int64) * C_IN + c_in_first + c_in_local) * H * W
        w_taps = w + (c_out.to(tl.int64) * cin_per_group + c_in_local) * KH * KW
        for kh in tl.static_range(KH):
            ih = oh * STRIDE_H - PAD_H + kh
            # Rows outside the image hold only padding, which reads as 0.
            if (ih >= 0) & (ih < H):
                for kw in tl.static_range(KW):
                    iw = ow * STRIDE_W - PAD_W + kw
                    inside = ow_in_range & (iw >= 0) & (iw < W)
                    xv = tl.load(x_plane + ih * W + iw, mask=inside, other=0.0)
                    wv = tl.load(w_taps + kh * KW + kw)
                    acc += xv.to(tl.float32) * wv.to(tl.float32)
    y_row = y + ((b.to(tl.int64) * C_OUT + c_out) * OH + oh) * OW
    tl.store(y_row + ow, acc.to(y.dtype.element_ty), mask=ow_in_range)


Conv2dForward = kernel_object(
    conv2d_forward,
    example=(3, 3, 1, 1, 1, 1, 1, 64),
    entry=conv2d_entry,
    nonnegative=("PAD_H", "PAD_W"),
    seed=True,
    helpers=(seed_row_tile,),
)


@triton.jit
def conv2d_backward(
    dy, x, w, dx, dw, B, C_IN, C_OUT, H, W, OH, OW,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, G: tl.constexpr, BLOCK_OW: tl.constexpr,
):
    """2-D convolution combined backward: dx and dw in one launch, on the forward's grid.

    Grid: pid = ((b * C_OUT + c_out) * OH + oh) * num_ow_tiles + ow_tile.
    One program reads dy[b, c_out, oh, ow] for the BLOCK_OW columns of its tile and, for each
    (c_in_local, kh, kw), with ih = oh*STRIDE_H - PAD_H + kh and iw = ow*STRIDE_W - PAD_W + kw inside the image:
        dx: atomic_add(dx[b, c_in, ih, iw], dy * w[c_out, c_in_local, kh, kw])
        dw: atomic_add(dw[c_out, c_in_local, kh, kw], sum over ow of dy * x[b, c_in, ih, iw])
    Contract: dx and dw must be zero-initialised before launch. Products in fp32; atomics in D.
    """
    y_plane, oh, ow, ow_in_range = seed_row_tile(OH, OW, BLOCK_OW)
    c_out = y_plane % C_OUT
    b = y_plane // C_OUT
    cin_per_group = C_IN // G
    c_in_first = (c_out // (C_OUT // G)) * cin_per_group
    dy_row = dy + ((b.to(tl.int64) * C_OUT + c_out) * OH + oh) * OW
    dyv = tl.load(dy_row + ow, mask=ow_in_range, other=0.0).to(tl.float32)
    for c_in_local in range(0, cin_per_group):
        plane = (b.to(tl.int64) * C_IN + c_in_first + c_in_local) * H * W
        tap = (c_out.to(tl.int64) * cin_per_group + c_in_local) * KH * KW
        for kh in tl.static_range(KH):
            ih = oh * STRIDE_H - PAD_H + kh
            # Rows outside the image hold only padding: nothing to read or scatter there.
            if (ih >= 0) & (ih < H):
                for kw in tl.static_range(KW):
                    iw = ow * STRIDE_W - PAD_W + kw
                    inside = ow_in_range & (iw >= 0) & (iw < W)
                    wv = tl.load(w + tap + kh * KW + kw).to(tl.float32)
                    xv = tl.load(x + plane + ih * W + iw, mask=inside, other=0.0).to(tl.float32)
                    tl.atomic_add(dx + plane + ih * W + iw, (dyv * wv).to(dx.dtype.element_ty), mask=inside)
                    tl.atomic_add(dw + tap + kh * KW + kw, tl.sum(dyv * xv, axis=0).to(dw.dtype.element_ty))


Conv2dBackward = kernel_object(
    conv2d_backward,
    example=(3, 3, 1, 1, 1, 1, 1, 64),
    entry=conv2d_entry,
    nonnegative=("PAD_H", "PAD_W"),
    seed=True,
    helpers=(seed_row_tile,),
)
