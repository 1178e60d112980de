"""Every tuning candidate of one convolution layer, each pass's runner timed on its own (`triton.testing.do_bench`,
median), beside torch's forward and backward (cuDNN, `cudnn.benchmark` on) in the same run: what tuning chooses
among, and what it would lose by keeping the wrong one.

    PYTHONPATH=. python3 tools/conv_candidates.py --batch 32 --channels 72 --size 56 --kernel 5 --stride 2 \
        --padding 2 --groups 72 --channels-last [--dtype bf16] [--count 6]

The calls are `nnkernels.functional.conv.choice_calls`'s (what `precompile` compiles). Needs a GPU.
"""
import argparse

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 32), ("channels", 64), ("out-channels", 0), ("size", 56), ("kernel", 3),
                          ("stride", 1), ("padding", 1), ("groups", 1), ("count", 6)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args(argv)
    from triton.testing import do_bench

    torch.backends.cudnn.benchmark = True
    dtype, out_channels = DTYPES[args.dtype], args.out_channels or args.channels
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    x = torch.randn(args.batch, args.channels, args.size, args.size, device="cuda", dtype=dtype)
    weight = torch.randn(out_channels, args.channels // args.groups, args.kernel, args.kernel, device="cuda",
                         dtype=dtype)
    x, weight = (t.contiguous(memory_format=memory_format) for t in (x, weight))
    from nnkernels.functional.conv import choice_calls

    first = lambda pass_: pass_.candidates()[:args.count]  # noqa: E731
    for name, choice, call in choice_calls(x, weight, args.stride, args.padding, 1, args.groups, choices=first):
        print(f"{name:8} {1e3 * do_bench(call):9.1f} µs  {choice}")
    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = torch.nn.functional.conv2d(xg, wg, None, args.stride, args.padding, 1, args.groups)
    dy = torch.randn_like(y)
    forward = 1e3 * do_bench(lambda: torch.nn.functional.conv2d(x, weight, None, args.stride, args.padding, 1,
                                                                args.groups))
    backward = 1e3 * do_bench(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
    print(f"torch    forward {forward:.1f} µs, backward (dx + dw) {backward:.1f} µs")


if __name__ == "__main__":
    main()
