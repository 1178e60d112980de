"""The kernels one training step of a converted ResNet-50 launches, counted with every launch stubbed out and the
plans built as on an H200: what an eager step pays in launches, NCHW or channels-last, on any machine.

    PYTHONPATH=. python3 tools/step_launches.py [--channels-last] [--image-size 64]

The model is torchvision's resnet50 where torchvision is installed, else the same bottleneck stack written here
(torchvision cannot be installed beside the CPU torch of the test machine). One step: forward under bf16
autocast, cross-entropy, backward, SGD with momentum, on a batch of 2. The first step builds the plans (with
tuning off and, on the CPU, the interpreter running the kernels); the second is counted.
"""
import argparse
import collections
import os

import torch
from torch import nn

H200 = dict(gpu=True, sms=132, tma=True, name="H200 (stubbed launches)")


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block: 1x1, 3x3 (the stride), 1x1 with four times the width, and the shortcut."""

    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = width * 4
        self.body = nn.Sequential(nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.shortcut = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50() -> nn.Module:
    try:
        import torchvision
    except ImportError:
        layers, c_in = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                        nn.MaxPool2d(3, 2, 1)], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for index in range(blocks):
                layers.append(Bottleneck(c_in, width, stride if index == 0 else 1))
                c_in = width * 4
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 1000))
    return torchvision.models.resnet50()


def main(argv=None) -> collections.Counter:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ["NNKERNELS_TUNE"] = "off"
    from nnkernels import launcher, machine
    from nnkernels.machine import Machine

    machine.machine_of = lambda device: Machine(**H200)  # for the rest of the process: this tool runs on its own
    import nnkernels

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nnkernels.convert(resnet50()).to(device)
    images = torch.randn(2, 3, args.image_size, args.image_size, device=device)
    if args.channels_last:
        model, images = model.to(memory_format=torch.channels_last), images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (2,), device=device)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast(device, torch.bfloat16):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)

    step()
    counts = collections.Counter()
    launcher.Launcher.__call__ = lambda self, *launch_args: counts.update((type(self.kernel).__name__,))
    step()
    layout = "channels_last" if args.channels_last else "NCHW"
    print(f"ResNet-50 {layout}, {args.image_size}x{args.image_size}: {sum(counts.values())} nnkernels launches a "
          f"training step")
    for name, count in counts.most_common():
        print(f"  {count:4d} {name}")
    return counts


if __name__ == "__main__":
    main()
