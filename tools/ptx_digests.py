"""A digest of the PTX of every kernel that a shipped choice of the given kernel classes launches: run it before
and after a change to those kernels' code that should not change what they compile to (a helper factored out),
and where every digest agrees, the shipped choices still hold and can be re-keyed to the new code.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 tools/ptx_digests.py OUT.json CLASS[,CLASS...]
    python3 tools/ptx_digests.py --compare BEFORE.json AFTER.json

Each kernel is built from its entry of `nnkernels/tuned.json` (the problem its key names, on an H200 with TMA;
a forward's choice for the flipped-tap dx problem too, which shares it) and compiled for sm_90 as a launch on
aligned tensors of those sizes specialises it; PTX lines of source locations and debug sections are dropped.
Compiles without a GPU; Triton's interpreter must be off (it patches the compiler's language).
"""
import argparse
import ast
import hashlib
import json
import re
import sys

PTX_DEBUG = re.compile(r"\s*(\.loc|\.file|//)")
DEBUG_SECTIONS = re.compile(r"\.section\s+\.debug")


def shipped_kernels(classes) -> dict:
    """{kernel id: (kernel object, its size arguments)} of the shipped conv choices' kernels of `classes`."""
    import torch

    from nnkernels import tuning
    from nnkernels.functional.conv_algorithms import algorithm_named, decode_choice
    from nnkernels.functional.conv_problem import Problem
    from nnkernels.machine import Machine

    h200 = Machine(gpu=True, sms=132, tma=True, name="NVIDIA H200")
    kernels = {}
    for key, stored in json.loads(tuning.SHIPPED_TABLE.read_text()).items():
        kind, shape = key.split("|")[:2]
        if not kind.startswith("conv2d_"):
            continue
        (batch, c_in, c_out, height, width, geometry, groups, dtype, tf32, has_bias, _), nhwc = (
            ast.literal_eval(shape)[:11], len(ast.literal_eval(shape)) > 11)
        kh, kw, *rest = geometry
        choice = decode_choice(stored)
        for flip in (False, True) if kind == "conv2d_forward" else (False,):
            p = Problem((batch, c_in, height, width), (c_out, c_in // groups, kh, kw), rest[0:2], rest[2:4],
                        rest[4:6], groups, getattr(torch, dtype.split(".")[1]), has_bias, h200, tf32=tf32,
                        flip_taps=flip, nhwc=nhwc)
            if flip and not p.forward_channels_last:
                continue
            for k in algorithm_named(choice.algorithm).kernels(p, choice.config):
                if type(k).__name__ in classes:
                    kernels[k.id] = (k, dict(B=batch, C_IN=c_in, C_OUT=c_out, H=height, W=width, OH=p.OH, OW=p.OW))
    return kernels


def ptx_digest(ptx: str) -> str:
    lines = [line for line in DEBUG_SECTIONS.split(ptx)[0].splitlines() if not PTX_DEBUG.match(line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs=2, metavar="PATH", help="OUT.json CLASSES, or BEFORE.json AFTER.json")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(open(path).read()) for path in args.paths)
        differ = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
        alone = sorted(before.keys() ^ after.keys())
        report = (f"{len(before.keys() & after.keys())} kernels in both, {len(differ)} compile differently, "
                  f"{len(alone)} in one only" + "".join(f"\n  differs: {k}" for k in differ)
                  + "".join(f"\n  one only: {k}" for k in alone))
        print(report)
        return report
    from nnkernels._mode import INTERPRETED

    if INTERPRETED:
        parser.error("Triton's interpreter is on: run with TRITON_INTERPRET=0")
    out, classes = args.paths[0], set(args.paths[1].split(","))
    digests = {kid: ptx_digest(k.triton_compile("sm_90", aligned=True, sizes=sizes).asm["ptx"])
               for kid, (k, sizes) in sorted(shipped_kernels(classes).items())}
    with open(out, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
    report = f"{out}: {len(digests)} kernels"
    print(report, file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
