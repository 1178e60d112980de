"""Settle, before Triton is first imported, whether this process runs Triton compiled or interpreted.

Triton fixes the mode when a `@triton.jit` function is decorated, its own library functions
included, so the choice is per process and must be made before `import triton`. With no CUDA
device and no explicit `TRITON_INTERPRET`, we choose the interpreter, so CPU tensors just work.
"""
import os
import sys

import torch

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Triton 3.9 warns on every process that leaves this unset; we keep its current default (fusion on).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402  (must follow the mode decision above)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
del triton

if INTERPRETED:
    from . import _interpreter_bf16  # noqa: F401,E402  (gives the interpreter bf16 atomics)
    from . import _interpreter_index  # noqa: F401,E402  (Triton 3.6's interpreter: scalars as indices)
