"""Strided subsampling of NCHW planes and its adjoint: `Subsample2dForward`, `Subsample2dBackward`.

A 1x1 convolution with stride s and no padding is a 1x1 stride-1 convolution of x[:, :, ::s, ::s];
nnkernels.conv2d runs it that way, on the per-image matrix-product kernels of conv2d_pointwise.py.
Measured on the H200 (ResNet-50's downsampling layers, B64 bf16), the implicit-GEMM kernels ran
them at 0.25x to 0.37x cuDNN's speed: the forward gathers single elements from NCHW, and dx
was written by stride phases, two bytes at every other address. These kernels take that
layout work: the forward's gather reads every s-th element once, the backward writes every
element of dx once, along rows.
"""
import triton
import triton.language as tl

from ...kernel import INTERPRETED, kernel_object
from ..common.checks import check_grid_3d, check_numel
from ..common.host_math import cdiv, next_power_of_2

# Elements per program: 4096 compiled (32 per thread at 4 warps), 2**16 in the interpreter, whose
# cost is per program and per operation.
TILE_ELEMENTS = 2**16 if INTERPRETED else 4096


def subsample_tiles(plane):
    """(BLOCK_R planes, BLOCK_P elements of each) of a launch whose planes hold `plane` elements:
    whole planes where they fit the tile (the small planes of late layers), else row pieces."""
    block_p = min(next_power_of_2(plane), TILE_ELEMENTS)
    return TILE_ELEMENTS // block_p, block_p


def _check_sizes(k, a):
    for name, out, size, stride in (("OH", a.OH, a.H, k.stride_h), ("OW", a.OW, a.W, k.stride_w)):
        if out != cdiv(size, stride):
            raise ValueError(f"{name}: expected cdiv({name[1]}, stride) = {cdiv(size, stride)}, got {out}")
    check_numel("x", a.x, a.ROWS * a.H * a.W, "ROWS*H*W")
    check_numel("y", a.y, a.ROWS * a.OH * a.OW, "ROWS*OH*OW")


def subsample_forward_entry(k, a):
    """Grid (cdiv(ROWS, BLOCK_R), cdiv(OH*OW, BLOCK_P)) for `Subsample2dForward`."""
    _check_sizes(k, a)
    return check_grid_3d(cdiv(a.ROWS, k.block_r), cdiv(a.OH * a.OW, k.block_p), 1)


def subsample_backward_entry(k, a):
    """Grid (cdiv(ROWS, BLOCK_R), cdiv(H*W, BLOCK_P)) for `Subsample2dBackward`."""
    _check_sizes(k, a)
    return check_grid_3d(cdiv(a.ROWS, k.block_r), cdiv(a.H * a.W, k.block_p), 1)


@triton.jit
def subsample2d_forward(
    x, y, ROWS, H, W, OH, OW,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """y = x[:, ::STRIDE_H, ::STRIDE_W] over ROWS planes (ROWS = B*C of an NCHW tensor), contiguous.

    Grid: (cdiv(ROWS, BLOCK_R), cdiv(OH*OW, BLOCK_P)). Program (i, j) writes, for planes
    r in [i*BLOCK_R, (i+1)*BLOCK_R) and pixels q in [j*BLOCK_P, (j+1)*BLOCK_P) inside ROWS and OH*OW,
        y[r, q] = x[r, (q // OW)*STRIDE_H, (q % OW)*STRIDE_W].
    OH = cdiv(H, STRIDE_H), OW = cdiv(W, STRIDE_W); one plane holds fewer than 2**31 elements.
    Every element of y is written, bit for bit.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    inside = (r < ROWS)[:, None] & (q < OH * OW)[None, :]
    source = (q // OW) * (STRIDE_H * W) + (q % OW) * STRIDE_W
    values = tl.load(x + (r.to(tl.int64) * H * W)[:, None] + source[None, :], mask=inside)
    tl.store(y + (r.to(tl.int64) * OH * OW)[:, None] + q[None, :], values, mask=inside)


@triton.jit
def subsample2d_backward(
    y, x, ROWS, H, W, OH, OW,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """The adjoint of subsample2d_forward: x (the gradient of its input) from y (that of its output).

    Grid: (cdiv(ROWS, BLOCK_R), cdiv(H*W, BLOCK_P)). Program (i, j) writes, for planes
    r in [i*BLOCK_R, (i+1)*BLOCK_R) and pixels p = h*W + w in [j*BLOCK_P, (j+1)*BLOCK_P) inside,
        x[r, h, w] = y[r, h / STRIDE_H, w / STRIDE_W]  where STRIDE_H divides h and STRIDE_W divides w,
        x[r, h, w] = 0                                 elsewhere.
    OH = cdiv(H, STRIDE_H), OW = cdiv(W, STRIDE_W). Every element of x is written, once, along rows.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    inside = (r < ROWS)[:, None] & (p < H * W)[None, :]
    h = p // W
    w = p % W
    on_lattice = (h % STRIDE_H == 0) & (w % STRIDE_W == 0)
    source = (h // STRIDE_H) * OW + w // STRIDE_W
    values = tl.load(y + (r.to(tl.int64) * OH * OW)[:, None] + source[None, :],
                     mask=inside & on_lattice[None, :], other=0.0)
    tl.store(x + (r.to(tl.int64) * H * W)[:, None] + p[None, :], values, mask=inside)


Subsample2dForward = kernel_object(subsample2d_forward, example=(2, 2, 8, 512), entry=subsample_forward_entry,
                                   num_warps=4)
Subsample2dBackward = kernel_object(subsample2d_backward, example=(2, 2, 8, 512), entry=subsample_backward_entry,
                                    num_warps=4)
