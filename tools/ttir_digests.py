"""A digest of the program (Triton's TTIR) of every kernel that a shipped choice of the given kernel classes
launches: run it before and after a change to those kernels' code that should not change what they compile (a
helper factored out), and where every digest agrees, the shipped choices still hold and can be re-keyed to the
new code.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 tools/ttir_digests.py [--examples] OUT.json CLASS[,CLASS...]
    python3 tools/ttir_digests.py --compare BEFORE.json AFTER.json

Each kernel is built from its entry of `nnkernels/tuned.json` (a convolution's or a batch norm's: the problem its
key names, on an H200 with TMA; a convolution forward's choice for the flipped-tap dx problem too, which shares it;
a batch-norm training forward's with and without the running-statistics update; a pooling pass's, NCHW lanes or
gather) and compiled for sm_90 as a launch on aligned tensors of those sizes specialises it. `--examples` adds the
kernels of representative problems that have no shipped entry (`POOLING_EXAMPLES`, `BATCH_NORM_EXAMPLES`): every
candidate config of each batch-norm step; of a pooling pass, the first candidate of each lane width and the gather
kernel (which takes every problem) on NCHW tensors, the first candidate on channels-last ones; so that the
constant-selected branches of kernels that no shipped choice launches are digested too.

The TTIR is the program after inlining and canonicalisation, before the passes that schedule it: later stages are
not the same from one build of a kernel to the next (a batch-norm merge kernel's TTGIR ordered its loop's carried
values either way between two builds of one cache key, and so its PTX), so they cannot tell a change apart from
that. Source locations are dropped. Compiles without a GPU; Triton's interpreter must be off (it patches the
compiler's language).
"""
import argparse
import ast
import hashlib
import json
import re
import sys

LOCATION = re.compile(r" loc\((?:[^()]|\([^()]*\))*\)")  # loc(#loc3), loc("x.py":12:5), loc(callsite(...))
VALUE = re.compile(r"%[\w$.-]+")  # %sum_dy_42, %12, %arg9, %c-1_i32
# A value's definition: `%y = op`, `scf.for %i = ...`, `iter_args(%acc = ...)`, an argument `%x: type`.
DEFINITION = re.compile(r" = |:(?!:)")
CONSTANT = re.compile(r"\s*(%[\w$.-]+) = arith\.constant (.*)$")  # %c8_i32 = arith.constant 8 : i32


H200 = dict(gpu=True, sms=132, tma=True, name="NVIDIA H200")

# Pooling problems of `--examples`: (planes, H, W, kernel, stride, padding, ceil_mode, count_include_pad, divisor).
# Between them: padded and unpadded, uniform and per-window divisors (counting the padding or not, ceil-mode
# overhang), divisor_override, windows tiling rows exactly (the gather forward's contiguous path), windows that
# take lanes from the left and from the right group, dy rows that do and do not vector-load, odd row lengths.
POOLING_EXAMPLES = (
    (64, 56, 56, (3, 3), (1, 1), (1, 1), False, True, 0),
    (64, 56, 56, (3, 3), (2, 2), (1, 1), False, False, 0),
    (64, 28, 28, (3, 3), (2, 2), (1, 1), True, True, 0),
    (64, 28, 28, (3, 3), (1, 1), (0, 0), False, True, 0),
    (64, 28, 28, (2, 2), (2, 2), (0, 0), False, True, 0),
    (64, 14, 14, (2, 2), (2, 2), (0, 0), False, True, 0),
    (64, 32, 32, (3, 3), (1, 1), (1, 1), False, True, 7),
    (64, 15, 15, (3, 3), (1, 1), (1, 1), False, False, 0),
    (64, 16, 16, (5, 5), (1, 1), (2, 2), False, True, 0),
)
# Images and channels of the channels-last pooling examples: a multiple of 16 channels (C_ALIGN 1), and 24 (C_ALIGN
# 8 or 4, `host_math.channel_alignment`).
POOLING_EXAMPLE_CHANNELS = (2, 64), (2, 24)
# Batch-norm problems of `--examples`: (B, C, H*W), each in both layouts.
BATCH_NORM_EXAMPLES = ((64, 256, 784), (8, 96, 49), (2, 3, 1000), (64, 64, 3136))
EXAMPLE_DTYPES = ("float32", "bfloat16")


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
        elif kind.startswith("avg_pool2d_"):
            found = _pooling_kernels(kind, ast.literal_eval(shape), stored)
        else:
            continue
        kernels.update((k.id, (k, sizes)) for k, sizes in found if type(k).__name__ in classes)
    return kernels


def example_kernels(classes) -> dict:
    """{kernel id: (kernel object, its size arguments)} of `classes`' kernels for the `--examples` problems."""
    found = []
    for dtype in EXAMPLE_DTYPES:
        for example in POOLING_EXAMPLES:
            found += _pooling_example_kernels(dtype, *example)
        for batch, channels, pixels in BATCH_NORM_EXAMPLES:
            for nhwc in ("nhwc",), ():
                found += _batch_norm_example_kernels(batch, channels, pixels, f"torch.{dtype}", nhwc)
    return {k.id: (k, sizes) for k, sizes in found if type(k).__name__ in classes}


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


def _batch_norm_problem(batch, channels, pixels, dtype, nhwc):
    """The batch-norm problem of a tuning key's shape, on an H200, and its layout's steps."""
    import torch

    from nnkernels.functional import batchnorm
    from nnkernels.functional.batchnorm_algorithms import BatchNormProblem
    from nnkernels.machine import Machine

    problem = BatchNormProblem((batch, channels, pixels), getattr(torch, dtype.split(".")[1]), None, Machine(**H200),
                               nhwc=bool(nhwc))
    return problem, batchnorm.steps_of(problem)


def _batch_norm_kernels(kind, shape, stored):
    batch, channels, pixels, dtype, *nhwc = shape
    problem, steps = _batch_norm_problem(batch, channels, pixels, dtype, nhwc)
    step = kind[len("batch_norm_"):].rsplit("_", 1)[0]
    config = problem.candidates(step)[1](stored)
    for each in ("train_forward", "train_forward_update") if step == "train_forward" else (step,):
        yield from ((k, dict(B=batch, C=channels, HW=pixels)) for k in steps[each][1](problem, config))


def _batch_norm_example_kernels(batch, channels, pixels, dtype, nhwc):
    """Every candidate's kernels of every step of one batch-norm problem."""
    problem, steps = _batch_norm_problem(batch, channels, pixels, dtype, nhwc)
    for step, (_, kernels_of) in steps.items():
        # The forward that updates the running statistics is tuned as the one that does not, as batch norm tunes it.
        for config in problem.candidates("train_forward" if step == "train_forward_update" else step)[0]():
            yield from ((k, dict(B=batch, C=channels, HW=pixels)) for k in kernels_of(problem, config))


def _pooling_pass(direction, dtype, shape):
    """The NCHW pooling pass (`PoolingPass`) of a tuning key's shape, on an H200."""
    import torch

    from nnkernels.functional.pooling_algorithms import PoolingPass
    from nnkernels.machine import Machine

    planes, height, width, out_h, out_w, kernel_size, stride, padding, count_include_pad, divisor = shape
    return PoolingPass(direction, getattr(torch, dtype), planes, height, width, out_h, out_w, kernel_size, stride,
                       padding, count_include_pad, divisor, Machine(**H200), None)


def _pooling_kernels(kind, shape, stored):
    direction = kind.rsplit("_", 1)[1]
    pooling = _pooling_pass(direction, shape[0], shape[1:])
    if pooling.kind != kind:
        raise ValueError(f"{kind}{shape}: the pass now takes {pooling.kind}")
    planes, height, width, out_h, out_w = pooling.sizes
    yield pooling.kernel(pooling.decode(stored)), dict(P=planes, H=height, W=width, OH=out_h, OW=out_w)


def _pooling_example_kernels(dtype, planes, height, width, kernel_size, stride, padding, ceil_mode,
                             count_include_pad, divisor):
    """The kernels of both passes of one pooling problem: on NCHW tensors the first candidate of each lane width and
    the gather kernel (which takes every problem); on channels-last ones the first candidate, for each of
    POOLING_EXAMPLE_CHANNELS."""
    import torch

    from nnkernels.functional.pooling_algorithms import ChannelsLastPoolingPass, gather_config
    from nnkernels.machine import Machine
    from nnkernels.ops.avg_pool2d.gather import pooled_size

    out_h, out_w = (pooled_size(size, k, s, p, ceil_mode)
                    for size, k, s, p in zip((height, width), kernel_size, stride, padding))
    window = (kernel_size, stride, padding, count_include_pad, divisor)
    for direction in ("forward", "backward"):
        pooling = _pooling_pass(direction, dtype, (planes, height, width, out_h, out_w, *window))
        sizes = dict(P=planes, H=height, W=width, OH=out_h, OW=out_w)
        # The tile sizes select no branch: the first candidate of each lane width, and the gather kernel's rule.
        configs = {}
        for config in pooling.candidates() if pooling.lanes else ():
            configs.setdefault(config.lanes, config)
        for config in (*configs.values(), gather_config(pooling.rows, pooling.cols, pooling.taps, pooling.machine)):
            yield pooling.kernel(config), sizes
        for batch, channels in POOLING_EXAMPLE_CHANNELS:
            pooling = ChannelsLastPoolingPass(direction, getattr(torch, dtype), batch, channels, height, width, out_h,
                                              out_w, *window, Machine(**H200), None)
            sizes = dict(B=batch, C=channels, H=height, W=width, OH=out_h, OW=out_w)
            yield pooling.kernel(pooling.candidates()[0]), sizes


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
    parser.add_argument("--examples", action="store_true",
                        help="also the kernels of the representative problems (POOLING_EXAMPLES, BATCH_NORM_EXAMPLES)")
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
    from nnkernels.kernel import INTERPRETED

    if INTERPRETED:
        parser.error("Triton's interpreter is on: run with TRITON_INTERPRET=0")
    out, classes = args.paths[0], set(args.paths[1].split(","))
    kernels = {**(example_kernels(classes) if args.examples else {}), **shipped_kernels(classes)}
    digests = {kid: ttir_digest(k.triton_compile("sm_90", aligned=True, sizes=sizes).asm["ttir"])
               for kid, (k, sizes) in sorted(kernels.items())}
    with open(out, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
    report = f"{out}: {len(digests)} kernels"
    print(report, file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
