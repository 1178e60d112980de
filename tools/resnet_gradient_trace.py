"""Trace where a converted ResNet-18's fp32 gradients first leave torch's, module by module.

    PYTHONPATH=. python3 tools/resnet_gradient_trace.py [cuda|cpu] [image size]

Runs torchvision's resnet18 and its `nnkernels.convert`ed copy on the same batch with TF32 off,
records every Conv2d/BatchNorm2d/Linear output and output gradient, and prints the relative
differences from the head down, then every parameter gradient over 1e-4. Written for the open
defect of issue 5 (fp32 gradients 1e-2 off on the H200, 3e-6 on the CPU interpreter).
(On a CPU-only machine set TRITON_INTERPRET=1: torchvision may import triton before nnkernels.)
"""
import copy
import sys

import torch
import torchvision

import nnkernels

TRACED = (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear)


def relative(ours, reference):
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).norm() / (reference.norm() + 1e-30)).item()


def record(model, tag, records):
    """Keep each traced module's output and, once backward reaches it, its output's gradient."""
    for name, module in model.named_modules():
        if isinstance(module, TRACED):
            def keep(module, inputs, output, name=name):
                records[(tag, "out", name)] = output.detach().clone()
                output.register_hook(lambda grad: records.__setitem__((tag, "grad", name), grad.detach().clone()))

            module.register_forward_hook(keep)


def main(device="cuda", size=64):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = torchvision.models.resnet18().to(device).train()
    ours = nnkernels.convert(copy.deepcopy(reference))
    images = torch.randn(8, 3, size, size, device=device)
    labels = torch.randint(0, 1000, (8,), device=device)
    records = {}
    record(ours, "ours", records)
    record(reference, "torch", records)
    for model in (ours, reference):
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    names = [name for name, module in reference.named_modules() if isinstance(module, TRACED)]
    print("outputs off by more than 1e-5:")
    for name in names:
        error = relative(records[("ours", "out", name)], records[("torch", "out", name)])
        if error > 1e-5:
            print(f"  {name:28} {error:.2e}")
    print("output gradients, from the head down:")
    for name in reversed(names):
        print(f"  {name:28} {relative(records[('ours', 'grad', name)], records[('torch', 'grad', name)]):.2e}")
    print("parameter gradients off by more than 1e-4:")
    for (name, ours_param), (_, torch_param) in zip(ours.named_parameters(), reference.named_parameters()):
        error = relative(ours_param.grad, torch_param.grad)
        if error > 1e-4:
            print(f"  {name:28} {error:.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda", int(sys.argv[2]) if len(sys.argv) > 2 else 64)
