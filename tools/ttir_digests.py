"""A digest of the program (Triton's TTIR) of every kernel that a shipped choice of the given kernel classes
launches: run it before and after a change to those kernels' code that should not change what they compile (a
helper factored out), and where every digest agrees, the shipped choices still hold and can be re-keyed to the
new code.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 tools/ttir_digests.py OUT.json CLASS[,CLASS...]
    python3 tools/ttir_digests.py --compare BEFORE.json AFTER.json

Each kernel is built from its entry of `nnkernels/tuned.json` (a convolution's or a batch norm's: the problem its
key names, on an H200 with TMA; a convolution forward's choice for the flipped-tap dx problem too, which shares it;
a batch-norm training forward's with and without the running-statistics update) and compiled for sm_90 as a
launch on aligned tensors of those sizes specialises it. The TTIR is the program after inlining and
canonicalisation, before the passes that schedule it: later stages are not the same from one build of a kernel to
the next (a batch-norm merge kernel's TTGIR ordered its loop's carried values either way between two builds of one
cache key, and so its PTX), so they cannot tell a change apart from that. Source locations are dropped.
Compiles without a GPU; Triton's interpreter must be off (it patches the compiler's language).
"""
import argparse
import ast
import hashlib
import json
import re
import sys

LOCATION = re.compile(r" loc\((?:[^()]|\([^()]*\))*\)")  # loc(#loc3), loc("x.py":12:5), loc(callsite(...))
VALUE = re.compile(r"%[\w$.]+")  # %sum_dy_42, %12, %arg9
# A value's definition: `%y = op`, `scf.for %i = ...`, `iter_args(%acc = ...)`, an argument `%x: type`.
DEFINITION = re.compile(r" = |:(?!:)")
CONSTANT = re.compile(r"\s*(%[\w$.]+) = arith\.constant (.*)$")  # %c8_i32 = arith.constant 8 : i32


H200 = dict(gpu=True, sms=132, tma=True, name="NVIDIA H200")


def shipped_kernels(classes) -> dict:
    """{kernel id: (kernel object, its size arguments)} of the shipped choices' kernels of `classes`."""
    from nnkernels import tuning

    table = json.loads(tuning.SHIPPED_TABLE.read_text())
    kernels = {}
    for key, stored in table.items():
        kind, shape = key.split("|")[:2]
        if kind.startswith("conv2d_"):
            found = _conv_kernels(kind, ast.literal_eval(shape), stored)
        elif kind.startswith("batch_norm_"):
            found = _batch_norm_kernels(kind, ast.literal_eval(shape), stored)
        else:
            continue
        kernels.update((k.id, (k, sizes)) for k, sizes in found if type(k).__name__ in classes)
    return kernels


def _conv_kernels(kind, shape, stored):
    import torch

    from nnkernels.functional.conv_algorithms import algorithm_named, decode_choice
    from nnkernels.functional.conv_problem import Problem
    from nnkernels.machine import Machine

    (batch, c_in, c_out, height, width, geometry, groups, dtype, tf32, has_bias, _), nhwc = shape[:11], len(shape) > 11
    kh, kw, *rest = geometry
    choice = decode_choice(stored)
    for flip in (False, True) if kind == "conv2d_forward" else (False,):
        p = Problem((batch, c_in, height, width), (c_out, c_in // groups, kh, kw), rest[0:2], rest[2:4], rest[4:6],
                    groups, getattr(torch, dtype.split(".")[1]), has_bias, Machine(**H200), tf32=tf32, flip_taps=flip,
                    nhwc=nhwc)
        if flip and not p.forward_channels_last:
            continue
        sizes = dict(B=p.B, C_IN=c_in, C_OUT=c_out, H=p.H, W=p.W, OH=p.OH, OW=p.OW)
        yield from ((k, sizes) for k in algorithm_named(choice.algorithm).kernels(p, choice.config))


def _batch_norm_kernels(kind, shape, stored):
    import torch

    from nnkernels.functional import batchnorm
    from nnkernels.functional.batchnorm_algorithms import BatchNormProblem
    from nnkernels.machine import Machine

    batch, channels, pixels, dtype, *nhwc = shape
    problem = BatchNormProblem((batch, channels, pixels), getattr(torch, dtype.split(".")[1]), None, Machine(**H200),
                               nhwc=bool(nhwc))
    step = kind[len("batch_norm_"):].rsplit("_", 1)[0]
    config = problem.candidates(step)[1](stored)
    steps = (batchnorm._NHWC_STEPS if problem.nhwc else batchnorm._NCHW_STEPS)
    for each in ("train_forward", "train_forward_update") if step == "train_forward" else (step,):
        yield from ((k, dict(B=batch, C=channels, HW=pixels)) for k in steps[each][1](problem, config))


def ttir_digest(ttir: str) -> str:
    """The TTIR's hash without its source locations (`loc(...)` operands and `#loc` lines), its constants named by
    their values and its other values renamed in the order they are defined, each use by the latest definition of
    its name: Triton names values after the Python variables, and hoists the constants in the order of their first
    uses, and MLIR's printer numbers the values of sibling regions (two loops' bodies) from the same count, all of
    which a refactor may change."""
    constants: dict = {}
    lines = []
    for line in ttir.splitlines():
        if line.startswith("#loc"):
            continue
        line = LOCATION.sub("", line)
        constant = CONSTANT.match(line)
        if constant:
            constants[constant.group(1)] = f"%const({constant.group(2)})"
        else:
            lines.append(line)
    names: dict = {}
    defined = [0]

    def rename(match):
        name = match.group(0)
        if name in constants:
            return constants[name]
        if DEFINITION.match(match.string, match.end()) or name not in names:
            defined[0] += 1
            names[name] = f"%v{defined[0]}"
        return names[name]

    canonical = "\n".join(VALUE.sub(rename, line) for line in lines)
    return hashlib.sha256(canonical.encode()).hexdigest()


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
    digests = {kid: ttir_digest(k.triton_compile("sm_90", aligned=True, sizes=sizes).asm["ttir"])
               for kid, (k, sizes) in sorted(shipped_kernels(classes).items())}
    with open(out, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
    report = f"{out}: {len(digests)} kernels"
    print(report, file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
