"""The shared-memory rings of a kernel's software-pipelined loops, read off its sm_90 TTGIR.

Triton's pipeliner stages each tile a loop loads through a ring of shared-memory slots, with copies
issued some steps ahead; an asynchronous wgmma (`warp_group_dot_wait` with pendings > 0) may still
be reading step i's slot while step i+1 runs. A ring that holds as many copies in flight as it has
slots refills step i's slot during step i+1: that races with the product. Triton 3.6 and 3.9 build
such a ring for a tile that feeds both a product and registers (see
`nnkernels.ops.common.tensor_core.sums_beside_dot`).

`rings(ttgir)` parses the text; run as a script (`python pipeline_rings.py` with a JSON list of
[module, class, {constant: value}, dtype, num_warps, num_stages] on stdin), it compiles each kernel
as Triton's JIT specialises launches on aligned tensors (pointers 16-byte aligned, every integer
argument a multiple of 16) and prints, per kernel, its rings and whether a product is asynchronous.
The script runs in its own process because an interpreted process cannot also run the compiler.
"""
import importlib
import json
import re
import sys
from dataclasses import dataclass


@dataclass
class Ring:
    slots: int  # the allocation's leading dimension
    ahead: int  # copies into it issued before the loop: the steps a copy runs ahead
    feeds_dot: bool  # a view of it is a warp_group_dot operand
    to_registers: bool  # a view of it is read by local_load


def _views(text, buffer):
    """The buffer and every memdesc view derived from it (memdesc_index, _trans, _reinterpret, ...)."""
    found, grew = {buffer}, True
    while grew:
        grew = False
        for view, source in re.findall(r"(%[\w.#]+) = ttg\.memdesc_\w+ (%[\w.#]+)", text):
            if source in found and view not in found:
                found.add(view)
                grew = True
    return found


def rings(text):
    """Every multi-slot shared allocation of the TTGIR `text`, as a `Ring`."""
    loop_start = text.find("scf.for")
    found = []
    for buffer, slots in re.findall(r"(%[\w.]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", text):
        views = _views(text, buffer)

        def uses(op):
            named = (m for m in re.finditer(rf"{op} [^:{{]*", text))
            return [m for m in named if any(re.search(rf"{re.escape(v)}(?![\w.#])", m.group(0)) for v in views)]

        ahead = [m for m in uses(r"(?:async_copy_global_to_local|async_tma_copy_global_to_local)")
                 if m.start() < loop_start]
        found.append(Ring(int(slots), len(ahead), bool(uses(r"warp_group_dot")), bool(uses(r"ttg\.local_load"))))
    return found


def async_products(text):
    """Whether a wgmma may still be running after its wait: some warp_group_dot_wait with pendings > 0."""
    return any(int(p) > 0 for p in re.findall(r"warp_group_dot_wait [^\n]*pendings = (\d+)", text))


def compile_ttgir(kernel):
    """The kernel object's sm_90 TTGIR, specialised as described in the module docstring."""
    return kernel.triton_compile("sm_90", aligned=True).asm["ttgir"]


def _main():
    import torch

    report = []
    for module, class_name, constants, dtype, num_warps, num_stages in json.load(sys.stdin):
        cls = getattr(importlib.import_module(module), class_name)
        values = dict(zip(cls.constant_names, cls.example_constants), **constants)
        kernel = cls(*(values[name] for name in cls.constant_names), dtype=getattr(torch, dtype),
                     num_warps=num_warps, num_stages=num_stages)
        text = compile_ttgir(kernel)
        report.append({"rings": [vars(ring) for ring in rings(text)], "async": async_products(text)})
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    _main()
