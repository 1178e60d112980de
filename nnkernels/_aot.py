"""Ahead-of-time compilation for processes that run Triton's interpreter.

An interpreted process cannot also run Triton's compiler: the interpreter patches Triton's
language functions for the whole process. So such a process compiles in a child process
that runs Triton compiled (it needs no GPU), and gets the PTX and cubin back.
"""
import importlib
import os
import pickle
import subprocess
import sys

import torch


def compile_in_subprocess(kernels, target):
    """Compile each kernel object of `kernels` for `target` in one child process; the results in order."""
    specs = [
        (type(k).__module__, type(k).__name__, tuple(k.constants.values()), str(k.dtype), k.num_warps, k.num_stages)
        for k in kernels
    ]
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-m", "nnkernels._aot", target],
        input=pickle.dumps(specs),
        capture_output=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"compiling for {target} failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
    return pickle.loads(done.stdout)


def _main(target):
    specs = pickle.loads(sys.stdin.buffer.read())
    built = []
    for module, class_name, constants, dtype, num_warps, num_stages in specs:
        cls = getattr(importlib.import_module(module), class_name)
        kernel = cls(*constants, dtype=getattr(torch, dtype.split(".")[-1]), num_warps=num_warps, num_stages=num_stages)
        built.append(kernel.build(target))
    sys.stdout.buffer.write(pickle.dumps(built))


if __name__ == "__main__":
    _main(sys.argv[1])
