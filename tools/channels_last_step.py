"""ResNet-50 training steps (batch 64, bf16 autocast, SGD with momentum), ms per eager step, torch and nnkernels
in NCHW and channels_last, in one process: the mean of 20 steps after 5, host timed around a synchronize.

    PYTHONPATH=. python tools/channels_last_step.py   (GPU; needs torchvision; writes $OUT/clstep.json if OUT is set)
"""
import json
import os
import time

import torch
import torchvision

import nnkernels


def step_ms(model, channels_last, steps=20, warmup=5):
    x = torch.randn(64, 3, 224, 224, device="cuda")
    target = torch.randint(0, 1000, (64,), device="cuda")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps * 1e3


def main():
    torch.backends.cudnn.benchmark = True
    rows = {}
    for name, make in (("torch", lambda: torchvision.models.resnet50().cuda()),
                       ("nnkernels", lambda: nnkernels.convert(torchvision.models.resnet50()).cuda())):
        for channels_last in (False, True):
            label = f"{name} {'channels_last' if channels_last else 'NCHW'}"
            rows[label] = step_ms(make(), channels_last)
            print(f"{label}: {rows[label]:.1f} ms", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "clstep.json"), "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
