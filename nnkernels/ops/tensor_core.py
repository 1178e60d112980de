"""The convolution kernels' one matrix product, and how fp32 goes through tensor cores.

fp32 with TF32 allowed (`torch.backends.cudnn.allow_tf32`, PyTorch's default) multiplies in TF32
(10-bit mantissas), as cuDNN does. With TF32 off, PyTorch promises full fp32 accuracy; the
products then use three TF32 products per term ("tf32x3": a = a_hi + a_lo with a_hi = tf32(a),
a_hi*b_hi + a_hi*b_lo + a_lo*b_hi), which keeps 21 to 22 bits of each product and sums in fp32.
Measured on the H200 (r50 3x3 layers, B32, fp32, max error over the largest |y| against float64):
2.2e-7 to 4.9e-7, where cuDNN's own fp32 gave 3.2e-7 to 3.3e-6 and Triton's FMA products
("ieee") 9.6e-7 to 2.8e-6; and 3x faster than the FMA products. An Inf input's low part,
a - tf32(a), is NaN: Triton's tf32x3 lowering (its F32DotTC pass) replaces NaN in the low-part
products by 0 (its compiled IR has the check in Triton 3.6 and 3.9), so Inf propagates as in fp32;
tests/test_special_values.py checks it on the GPU.
"""
import triton
import triton.language as tl


@triton.jit
def conv_dot(a, b, acc, TF32: tl.constexpr):
    """acc + a @ b on tensor cores with fp32 accumulation: TF32 products for fp32 when TF32, the
    three-product tf32x3 otherwise (16-bit inputs multiply exactly either way)."""
    precision: tl.constexpr = "tf32" if TF32 else "tf32x3"
    return tl.dot(a, b, acc, input_precision=precision)
