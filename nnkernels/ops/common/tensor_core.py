"""The convolution kernels' matrix products, and how fp32 goes through tensor cores.

fp32 with TF32 allowed (`torch.backends.cudnn.allow_tf32`, PyTorch's default) multiplies in TF32
(10-bit mantissas), as cuDNN does. With TF32 off, PyTorch promises full fp32 accuracy; the
products then use three TF32 products per term ("tf32x3": a = a_hi + a_lo with a_hi = tf32(a),
a_hi*b_hi + a_hi*b_lo + a_lo*b_hi), which keeps 21 to 22 bits of each product and sums in fp32:
as accurate as cuDNN's own fp32 and Triton's FMA products ("ieee"), and faster than the latter
(docs/notes.md, "fp32 on tensor cores: tf32x3, bf16x3, rounding"). An Inf input's low part,
a - tf32(a), is NaN: Triton's tf32x3 lowering (its F32DotTC pass) replaces NaN in the low-part
products by 0 (its compiled IR has the check in Triton 3.6 and 3.9), so Inf propagates as in fp32;
tests/test_special_values.py checks it on the GPU.

TF32 tensor cores read only tiles whose reduced dimension is the contiguous one (K-major) from shared
memory. Where a kernel's fp32 tile runs along another dimension (NCHW pixels in the 1x1 kernels,
channels-last channels in the TMA weight gradient), Triton writes it to shared memory transposed, 4
bytes at a time, which left those kernels behind cuDNN in TF32. Two ways round it:

- `tf32_rounded`: wgmma also takes its first operand from registers, in any layout. A tile that is
  computed, not loaded, stays there, so the 1x1 kernels make the pixel-major x tile the first operand
  (y^T = x^T @ w^T) and round it to TF32 themselves; the weight tile, the second operand, is K-major.
  Faster there than the three bf16 products below, with an error between cuDNN's TF32 and the
  channels-last kernels', which truncate both operands.
- `bf16x3_dot`, where both operands are tiles of the wrong major-ness (the weight gradient's): bf16
  tensor cores read either, so it splits each fp32 value into two bf16 parts (hi = bf16(v), lo =
  bf16(v - hi), 16 bits of v in all) and sums three bf16 products, hi*hi + hi*lo + lo*hi (the dropped
  lo*lo is under 2^-16 of the product; 4.4e-6 of the result's norm over random data). It is far more
  accurate than TF32 and, where TF32 had to transpose, faster on all but the smallest planes (the TMA
  weight gradient of r50's 3x3 layers; docs/notes.md, "fp32 on tensor cores: tf32x3, bf16x3, rounding").
  Keeping the low-part products in their own accumulator (`bf16x3_total`) is what makes Inf safe
  without guarding every element: splits that zero the Inf of hi for the cross products were slower.
"""
import triton
import triton.language as tl


@triton.jit
def conv_dot(a, b, acc, TF32: tl.constexpr):
    """acc + a @ b on tensor cores with fp32 accumulation: TF32 products for fp32 when TF32, the
    three-product tf32x3 otherwise (16-bit inputs multiply exactly either way)."""
    precision: tl.constexpr = "tf32" if TF32 else "tf32x3"
    return tl.dot(a, b, acc, input_precision=precision)


@triton.jit
def tf32_rounded(v):
    """An fp32 tile rounded to TF32 (10 mantissa bits; to nearest, ties away from zero, as PTX's
    cvt.rna.tf32.f32), still fp32: tensor cores then multiply it exactly as it is. Inf and NaN stay what
    they are; finite values within half a TF32 step of fp32's largest become Inf, as with cvt.rna."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)  # a NaN whose payload is all in the dropped bits would become Inf


@triton.jit
def bf16_parts(v):
    """(hi, lo) of an fp32 tile, both bf16: hi = bf16(v), lo = bf16(v - hi). lo is NaN where v is Inf or
    NaN; hi is Inf beyond bf16's largest value (fp32 values within 0.2% of fp32's largest)."""
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def bf16x3_dot(a, b, acc, cross):
    """(acc + a_hi @ b_hi, cross + a_hi @ b_lo + a_lo @ b_hi) on bf16 tensor cores with fp32 accumulation,
    for fp32 tiles of either major-ness (`bf16_parts`); 16-bit tiles: (acc + a @ b, cross). The low-part
    products go to their own accumulator: `bf16x3_total` adds it once the reduction is done."""
    if a.dtype == tl.float32:
        a_hi, a_lo = bf16_parts(a)
        b_hi, b_lo = bf16_parts(b)
        acc = tl.dot(a_hi, b_hi, acc)
        cross = tl.dot(a_hi, b_lo, cross)
        cross = tl.dot(a_lo, b_hi, cross)
    else:
        acc = tl.dot(a, b, acc)
    return acc, cross


@triton.jit
def bf16x3_total(acc, cross, OPERAND: tl.constexpr):
    """For fp32 operands (OPERAND, their dtype), acc + cross where cross is finite; otherwise acc.
    A non-finite cross comes only from an Inf or NaN input (its low part is NaN; an Inf times a low
    part of the other sign adds -Inf to hi*hi's +Inf), and the same input makes acc, the sum of
    hi*hi, non-finite exactly as the fp32 sum of products would be: acc alone is then the answer."""
    if OPERAND == tl.float32:
        acc = acc + tl.where(tl.abs(cross) < float("inf"), cross, 0.0)
    return acc


BF16X3_HELPERS = (bf16x3_dot, bf16_parts, bf16x3_total)  # for kernel objects' `helpers` (their source and hash)


@triton.jit
def sums_beside_dot(sums, pointers, mask, AXIS: tl.constexpr):
    """sums + the fp32 sums along AXIS of the tile at `pointers` (0 where not `mask`), for a tile that the
    same loop step also loads as a `tl.dot` operand (the Winograd products' bias sums).

    The tile is loaded again here rather than summed from the operand. A loaded tile that feeds both an
    asynchronous wgmma and registers gets a shared-memory ring one slot too short from Triton's software
    pipeliner (seen in 3.6 and 3.9 on sm_90): the copy for step i+2 overwrites the slot that step i's
    product may still be reading. On the H200 the 1x1 dw with bias, 128 x 128 tiles, 8 warps, 3 stages,
    gave a different result on each of 19 launches, off by up to 0.2 of the largest sum. The second
    load has its own eviction policy, so the compiler does not merge the two loads; it reads the tile
    from registers, and the product's ring keeps its full depth (tests/test_pipeline_rings.py).
    It cost the 1x1 dw 1.2x to 1.5x its time without bias, so the split dw kernels give the bias sums
    programs of their own instead (1.0x to 1.1x on most shapes; docs/notes.md, "Weight gradients"). The
    Winograd products keep it: only the first column tile of one of their 16 points sums."""
    tile = tl.load(pointers, mask=mask, other=0.0, eviction_policy="evict_first")
    return sums + tl.sum(tile.to(tl.float32), axis=AXIS)
