"""Trace where a converted ResNet-18's fp32 gradients first leave torch's, module by module.

    PYTHONPATH=. python3 tools/resnet_gradient_trace.py [cuda|cpu] [image size] [classes]

Runs torchvision's resnet18 and two `nnkernels.convert`ed copies on the same batch with TF32
off, records every Conv2d/BatchNorm2d/Linear output and output gradient, and prints the relative
differences from the head down (ours against torch, and ours against ours: a run-to-run
difference means a race), then every parameter gradient over 1e-4. Written for the defect of
issue 5 (fp32 gradients 1e-2 off on the H200 in tests/test_resnet.py, which uses 10 classes).
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


def main(device="cuda", size=64, classes=10):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=classes).to(device).train()
    models = {"torch": reference, "ours": nnkernels.convert(copy.deepcopy(reference)),
              "ours again": nnkernels.convert(copy.deepcopy(reference))}
    generator = torch.Generator().manual_seed(1000)
    images = torch.randn(8, 3, size, size, generator=generator).to(device)
    labels = torch.randint(0, classes, (8,), generator=generator).to(device)
    records = {}
    for tag, model in models.items():
        record(model, tag, records)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    names = [name for name, module in reference.named_modules() if isinstance(module, TRACED)]
    print("outputs off by more than 1e-5 (vs torch, vs ours again):")
    for name in names:
        errors = [relative(records[("ours", "out", name)], records[(other, "out", name)])
                  for other in ("torch", "ours again")]
        if max(errors) > 1e-5:
            print(f"  {name:28} {errors[0]:.2e} {errors[1]:.2e}")
    print("output gradients, from the head down (vs torch, vs ours again):")
    for name in reversed(names):
        errors = [relative(records[("ours", "grad", name)], records[(other, "grad", name)])
                  for other in ("torch", "ours again")]
        print(f"  {name:28} {errors[0]:.2e} {errors[1]:.2e}")
    print("parameter gradients off by more than 1e-4 (vs torch, vs ours again):")
    for (name, ours), (_, torch_param), (_, again) in zip(models["ours"].named_parameters(),
                                                          reference.named_parameters(),
                                                          models["ours again"].named_parameters()):
        errors = relative(ours.grad, torch_param.grad), relative(ours.grad, again.grad)
        if max(errors) > 1e-4:
            print(f"  {name:28} {errors[0]:.2e} {errors[1]:.2e}")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(arguments[0] if arguments else "cuda", *(int(a) for a in arguments[1:3]))
