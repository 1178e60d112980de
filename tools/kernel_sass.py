"""The instruction mix of one kernel object's sm_90 code, without a GPU: how many instructions of
each opcode its cubin holds, and its registers per thread. For kernels bound by instructions
rather than bytes (docs/notes.md, depthwise): loads, predicates and address
arithmetic per FMA are read here before any device time is spent.

    PYTHONPATH=. python3 tools/kernel_sass.py CLASS DTYPE CONSTANT... [--warps N] [--stages N] [--listing]
                                              [--aligned [--size NAME=VALUE ...]]
    PYTHONPATH=. python3 tools/kernel_sass.py Conv2dDepthwiseForward bf16 3 3 1 1 1 1 1 1 False 4 14 32 True

CONSTANT: the kernel class's constants in order (ints, True, False). Without `--aligned` the build assumes
nothing of the arguments (as `compile` does), so loads of 16-byte runs show as single elements; `--aligned`
specialises as a launch on aligned tensors does, every size a multiple of 16 unless `--size` gives its value
(e.g. `--size H=56 --size W=56`). The memory line counts loads and stores with their widths (`LDG.E.128`: 16
bytes, `LDGSTS`: asynchronous copies). Uses the cuobjdump that ships with Triton's NVIDIA backend.
"""
import argparse
import ast
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton

from nnkernels.kernel import INTERPRETED
from nnkernels.kernel import DTYPE_NAMES, catalogue

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# "/*0a40*/   @!P0 LDG.E.U16 R3, desc[UR4][R4.64] ;": the address, an optional predicate, the opcode
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_MEMORY = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?"
                     r"((?:LDG|STG|LDGSTS|LDS|STS|LDL|STL|LDSM|STSM)\b[A-Z0-9_.]*)")


def opcode_counts(sass: str) -> collections.Counter:
    """{opcode without modifiers: count} over the instructions of a `cuobjdump -sass` listing."""
    return collections.Counter(_INSTRUCTION.findall(sass))


def memory_counts(sass: str) -> collections.Counter:
    """{global, shared and local load / store opcode with its modifiers (width): count} of a listing."""
    return collections.Counter(_MEMORY.findall(sass))


def registers(resource_usage: str) -> int:
    """Registers per thread from a `cuobjdump -res-usage` listing of one kernel."""
    return int(re.search(r"REG:(\d+)", resource_usage).group(1))


def _cuobjdump(option: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(CUOBJDUMP), option, f.name], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="tools/kernel_sass.py", description=__doc__.splitlines()[0])
    parser.add_argument("kernel_class", help="a class of the catalogue, e.g. Conv2dDepthwiseForward")
    parser.add_argument("dtype", choices=sorted(DTYPE_NAMES.values()))
    parser.add_argument("constants", nargs="*", help="the class's constants, in order")
    parser.add_argument("--warps", type=int, help="num_warps (default: the class's)")
    parser.add_argument("--stages", type=int, help="num_stages (default: the class's)")
    parser.add_argument("--aligned", action="store_true", help="specialise as a launch on aligned tensors")
    parser.add_argument("--size", action="append", default=[], metavar="NAME=VALUE",
                        help="with --aligned: an integer argument's value")
    parser.add_argument("--listing", action="store_true", help="print the SASS too")
    args = parser.parse_args(argv)
    sizes = {}
    for given in args.size:
        name, _, value = given.partition("=")
        if not value.isdigit():
            parser.error(f"--size: expected NAME=VALUE with an integer VALUE, got {given!r}")
        sizes[name] = int(value)
    classes = {cls.__name__: cls for cls in catalogue()}
    if args.kernel_class not in classes:
        parser.error(f"kernel_class: expected one of {', '.join(sorted(classes))}, got {args.kernel_class!r}")
    dtype = next(torch_dtype for torch_dtype, name in DTYPE_NAMES.items() if name == args.dtype)
    kernel = classes[args.kernel_class](*(ast.literal_eval(c) for c in args.constants), dtype=dtype,
                                        num_warps=args.warps, num_stages=args.stages)
    unknown = set(sizes) - {name for name, kind in kernel.signature.items() if kind.startswith("i")}
    if unknown:
        parser.error(f"--size: {', '.join(sorted(unknown))} is not an integer argument of {args.kernel_class}")
    if args.aligned:
        if INTERPRETED:  # the interpreter patches Triton's language for the whole process
            parser.error("--aligned: compiles in this process, which runs Triton's interpreter; run the tool in a "
                         "process of its own")
        cubin = kernel.triton_compile("sm_90", aligned=True, sizes=sizes).asm["cubin"]
    else:
        cubin = kernel.compile("sm_90").cubin
    sass = _cuobjdump("-sass", cubin)
    counts = opcode_counts(sass)
    lines = [kernel.id,
             f"{sum(counts.values())} instructions, {registers(_cuobjdump('-res-usage', cubin))} registers per thread",
             ", ".join(f"{opcode} {n}" for opcode, n in counts.most_common()),
             "memory: " + ", ".join(f"{opcode} {n}" for opcode, n in sorted(memory_counts(sass).items()))]
    report = "\n".join(lines + ([sass] if args.listing else []))
    print(report)
    return report


if __name__ == "__main__":
    main()
