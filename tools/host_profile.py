"""Where one op call's host time goes: a `nnkernels bench host` case called back to back, its µs per call beside
a no-op autograd Function's, and the functions that took the time (cProfile, by own time).

    PYTHONPATH=. python3 tools/host_profile.py ["conv2d 3x3 64->64"] [--calls N] [--top N]    # on the GPU
    PYTHONPATH=. python3 tools/host_profile.py --stub-launches [CASE]                      # any machine

`--stub-launches` builds the plans as on an H200 (in the interpreter where there is no GPU), then replaces every
launch by a count: what is left is the Python of nnkernels and of autograd, and the launches per call.
"""
import argparse
import cProfile
import io
import pstats

import torch

H200 = dict(gpu=True, sms=132, tma=True, name="H200 (stubbed launches)")


class NoopFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return dy


def per_call_us(call, calls, synchronize) -> float:
    """`nnkernels bench host`'s timing (the best of its rounds of back-to-back calls), in µs."""
    from nnkernels.bench.host import host_ms

    return 1e3 * host_ms(call, synchronize, calls=calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", default="conv2d 3x3 64->64")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--stub-launches", action="store_true")
    args = parser.parse_args(argv)
    if args.stub_launches:
        from nnkernels import machine
        from nnkernels.machine import Machine

        machine.machine_of = lambda device: Machine(**H200)
    from nnkernels import launcher
    from nnkernels.bench import host

    device = "cuda" if torch.cuda.is_available() else "cpu"
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cases = host.cases(device, torch.bfloat16)
    if args.case not in cases:
        parser.error(f"case: expected one of {', '.join(map(repr, cases))}, got {args.case!r}")
    ours, theirs = cases[args.case]
    ours()  # builds the plans: compiles (and tunes, on the GPU)
    launches = [0]
    if args.stub_launches:  # for the rest of the process: this tool runs on its own
        launcher.Launcher.__call__ = lambda self, *launch_args: launches.__setitem__(0, launches[0] + 1)
        ours()
        per_call = launches[0]
    x = torch.randn(2, 64, 8, 8, device=device, requires_grad=True)

    def noop():
        y = NoopFunction.apply(x)
        torch.autograd.grad(y, (x,), torch.ones_like(y))

    print(f"{args.case}: nnkernels {per_call_us(ours, args.calls, synchronize):.1f} µs per forward + backward"
          + (f" ({per_call} launches, stubbed)" if args.stub_launches else
             f", torch {per_call_us(theirs, args.calls, synchronize):.1f}")
          + f"; a no-op autograd Function {per_call_us(noop, args.calls, synchronize):.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        ours()
    synchronize()
    profile.disable()
    report = io.StringIO()
    pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(args.top)
    print(report.getvalue())


if __name__ == "__main__":
    main()
