"""bf16 atomic add for Triton's interpreter, which has none ("Unsupported data type"), a
bf16 `tl.dot`, which it computes on the raw uint16 bits (garbage), and fp32 -> bf16 casts rounded
to nearest even as the GPU rounds them (the interpreter truncates). Float dots go through fp32
and numpy's BLAS matmul (the interpreter's `np.matmul(..., dtype=)` takes a loop that is ~50x slower).

The interpreter runs one program at a time and one operation at a time, so a read, an add in
fp32 and a write, lane by lane, is exactly an atomic add there; lanes go one by one so that
lanes hitting the same address each add their share, as the hardware's atomics do.
"""
import numpy as np
import torch
import triton.language as tl
from triton._C.libtriton import interpreter as _interpreter
from triton._C.libtriton import ir as _ir
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

_atomic_rmw = InterpreterBuilder.create_atomic_rmw
_ONE = np.ones(1, dtype=bool)
_ZERO = np.zeros(1, dtype=np.uint16)


def _bf16_bits_to_fp32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float()


def _fp32_to_bf16_bits(values: torch.Tensor) -> np.ndarray:
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
    if val.dtype.scalar != tl.bfloat16 or rmwOp != _ir.ATOMIC_OP.FADD:
        return _atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope)
    addresses = np.atleast_1d(ptr.data).ravel()
    addends = np.atleast_1d(val.data).ravel()
    live = np.broadcast_to(mask.data, np.shape(ptr.data)).ravel()
    previous = np.zeros_like(addends)
    for lane in np.flatnonzero(live):
        address = addresses[lane : lane + 1]
        current = _interpreter.load(address, _ONE, _ZERO, np.dtype(np.uint16))
        previous[lane] = current[0]
        total = _bf16_bits_to_fp32(current) + _bf16_bits_to_fp32(addends[lane : lane + 1])
        _interpreter.store(address, _fp32_to_bf16_bits(total), _ONE)
    return TensorHandle(previous.reshape(np.shape(val.data)), tl.bfloat16)


_dot = InterpreterBuilder.create_dot


def _as_fp32(t: TensorHandle) -> np.ndarray:
    if t.dtype.scalar == tl.bfloat16:
        return _bf16_bits_to_fp32(t.data).numpy().reshape(np.shape(t.data))
    return np.ascontiguousarray(t.data, dtype=np.float32)


def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    floats = (tl.bfloat16, tl.float16, tl.float32)
    if a.dtype.scalar not in floats or b.dtype.scalar not in floats or d.data.dtype != np.float32:
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    return TensorHandle(np.matmul(_as_fp32(a), _as_fp32(b)) + d.data, d.dtype.scalar)


_cast = InterpreterBuilder.cast_impl


def cast_impl(self, src, dst_type):
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _cast(self, src, dst_type)
    values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
    return TensorHandle(_fp32_to_bf16_bits(values), tl.bfloat16)


InterpreterBuilder.create_atomic_rmw = create_atomic_rmw
InterpreterBuilder.create_dot = create_dot
InterpreterBuilder.cast_impl = cast_impl
