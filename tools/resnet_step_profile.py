"""Where a ResNet-50 training step's GPU time goes: every kernel of the converted model's step
and of torch's, with its total µs per step (torch.profiler, mean of 3 steps after 3), grouped.

    PYTHONPATH=. python3 tools/resnet_step_profile.py [--batch 64] [--channels-last]

Same step as `nnkernels bench models resnet50` (bf16 autocast, SGD; NCHW, or with model and images in
torch.channels_last), run eagerly: each
kernel's own GPU time does not depend on how it was launched, so the per-kernel sums show what
a CUDA-graph replay of the step spends, less the gaps. Prints, per side, the time per group
(convolution forward / data gradient / weight gradient, layout copies, batch norm, pooling, the
rest) and the 25 largest kernels.
"""
import argparse
import collections
import copy
import re

import torch

from nnkernels.bench import harness
from nnkernels.bench.models import IMAGE_SIZE, NUM_CLASSES, make_step

STEPS = 3
# First match wins; names are Triton function names (ours) and cuDNN/CUTLASS/ATen kernel names (torch's).
GROUPS = (
    ("batch norm", r"batch_norm|bn_fw|bn_bw|welford"),
    ("pooling", r"pool"),
    ("conv dw", r"_dw|wgrad|conv2d_dw_reduce"),
    ("conv dx", r"_dx|dgrad"),
    ("layout copy", r"channels_last_copy|nchwToNhwc|nhwcToNchw|transpose"),
    ("conv fwd", r"conv2d|xmma|cutlass|sm90|implicit|gemm|fprop"),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--channels-last", action="store_true", help="model and images in torch.channels_last")
    args = parser.parse_args()
    import torchvision

    from nnkernels.nn import convert

    torch.manual_seed(0)
    reference = torchvision.models.resnet50().cuda()
    ours = convert(copy.deepcopy(reference))
    images = torch.randn(args.batch, 3, IMAGE_SIZE, IMAGE_SIZE, device="cuda")
    labels = torch.randint(0, NUM_CLASSES, (args.batch,), device="cuda")
    if args.channels_last:
        reference, ours = (m.to(memory_format=torch.channels_last) for m in (reference, ours))
        images = images.contiguous(memory_format=torch.channels_last)
    for side, model in (("ours", ours), ("torch", reference)):
        totals = harness.kernel_times(make_step(model, images, labels), STEPS)
        groups = collections.Counter()
        for name, us in totals.items():
            groups[group_of(name)] += us
        print(f"== {side}: {sum(totals.values()) / 1000:.2f} ms of kernels per step")
        for group, us in groups.most_common():
            print(f"   {us / 1000:8.3f} ms  {group}")
        for name, us in totals.most_common(25):
            print(f"   {us:8.1f} us  [{group_of(name)}] {name}")


if __name__ == "__main__":
    main()
