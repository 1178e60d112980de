"""Where a convolution's time goes: the CUDA time of every kernel of nnkernels.conv2d and of
torch's F.conv2d, forward + backward, per bench layer (torch.profiler, mean of 5 steps after 3).

    PYTHONPATH=. python3 tools/conv_kernel_profile.py ["layer name,layer name" (default: the whole suite)]
    PYTHONPATH=. python3 tools/conv_kernel_profile.py resnet50   (the resnet50_convs layers, bf16 only)

Both sides run in the same process on the same inputs (those of `nnkernels.bench.conv2d`), in
bf16 and in fp32 with TF32; the eight largest kernels of each are printed with their µs.
"""
import sys

import torch

import nnkernels
from nnkernels.bench import harness
from nnkernels.bench.conv2d import SUITE, layer_tensors
from nnkernels.bench.resnet50_convs import RESNET50

STEPS = 5


def kernel_times(layer, dtype, conv):
    """{kernel name: mean µs per forward + backward step} for `conv` (nnkernels' or torch's)."""
    x, w, dy = layer_tensors(layer, dtype)
    x.requires_grad_()
    w.requires_grad_()

    def step():
        conv(x, w, None, layer.stride, layer.padding, 1, layer.groups).backward(dy)

    return harness.kernel_times(step, STEPS, name_length=70)


def main(names=None):
    suite, dtypes = SUITE, (torch.bfloat16, torch.float32)
    if names == ["resnet50"]:
        suite, dtypes, names = RESNET50, (torch.bfloat16,), None
    for dtype in dtypes:
        torch.backends.cudnn.allow_tf32 = True
        for layer in suite:
            if names and layer.name not in names:
                continue
            for side, conv in (("ours", nnkernels.conv2d), ("torch", torch.nn.functional.conv2d)):
                totals = kernel_times(layer, dtype, conv)
                print(f"== {layer.name} {dtype} {side} total {sum(totals.values()):.1f} us")
                for name, us in totals.most_common(8):
                    print(f"   {us:8.1f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else None)
