"""Seconds to a torchvision model's first training step in this process, one way (BENCHMARKS.md, "First training
step"): `torch` (cudnn.benchmark on), `ours` (convert, then the step), `ours-warmup` (convert,
`nnkernels.warmup(model, images)` with its default jobs, then the step). Batch 64, 224x224, bf16 autocast, SGD
with momentum, as `nnkernels bench models`. Run each way in a fresh process; point TRITON_CACHE_DIR and
NNKERNELS_CACHE_DIR at empty directories for a cold start.

    PYTHONPATH=. python3 tools/first_step.py ours-warmup [--model resnet50]     # on the GPU
"""
import argparse
import json
import logging
import time

began = time.perf_counter()

import torch  # noqa: E402  (importing torch is part of what a user waits for)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("way", choices=["torch", "ours", "ours-warmup"])
    parser.add_argument("--model", default="resnet50")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what nnkernels says it is compiling
    import torchvision

    from nnkernels.bench.models import BATCH, IMAGE_SIZE, NUM_CLASSES, make_step

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).cuda()
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, device="cuda")
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), device="cuda")
    times = {"import_s": time.perf_counter() - began}
    if args.way != "torch":
        import nnkernels

        model = nnkernels.convert(model)
    step = make_step(model, images, labels)
    ready = time.perf_counter()
    if args.way == "ours-warmup":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            summary = nnkernels.warmup(model, images, progress=False)
        torch.cuda.synchronize()
        times["warmup_s"] = time.perf_counter() - ready
        times["warmup_serial_s"] = summary.seconds
    step_began = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times["step_s"] = time.perf_counter() - step_began
    times["first_step_s"] = time.perf_counter() - ready
    times["total_s"] = time.perf_counter() - began
    print(json.dumps({"way": args.way, "model": args.model, **{k: round(v, 2) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
