"""ResNet-50 training steps (batch 64, bf16 autocast, SGD with momentum), ms per eager step, torch and nnkernels
in NCHW and channels_last, each way in a process of its own (so that no way inherits another's allocator state):
the mean of 20 steps after 5, host timed around a synchronize.

    PYTHONPATH=. python tools/channels_last_step.py   (GPU; needs torchvision; writes $OUT/clstep.json if OUT is set)
"""
import json
import os
import subprocess
import sys
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


MODELS = {"torch": lambda: torchvision.models.resnet50().cuda(),
          "nnkernels": lambda: nnkernels.convert(torchvision.models.resnet50()).cuda()}


def main():
    if len(sys.argv) == 3:  # one way, in this process: print its ms
        torch.backends.cudnn.benchmark = True
        print(step_ms(MODELS[sys.argv[1]](), sys.argv[2] == "channels_last"))
        return
    rows = {}
    for name in MODELS:
        for layout in ("NCHW", "channels_last"):
            run = subprocess.run([sys.executable, __file__, name, layout], capture_output=True, text=True, check=True)
            rows[f"{name} {layout}"] = float(run.stdout.split()[-1])
            print(f"{name} {layout}: {rows[f'{name} {layout}']:.1f} ms", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "clstep.json"), "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
