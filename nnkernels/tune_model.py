"""`nnkernels tune MODEL`: build a model, convert it, and warm up (compile and tune) one training step of it.

MODEL is a torchvision model name (`resnet50`) or `module:function`, a callable of no arguments that returns a
`torch.nn.Module`. On the GPU the tuned choices are remembered (see `nnkernels.tuning`), so the training
that follows starts with them.
"""
from __future__ import annotations

import contextlib
import importlib

import click
import torch

from . import nn as nnk
from .kernel import INTERPRETED
from .step_warmup import warmup

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(spec: str) -> torch.nn.Module:
    """The model `spec` names; a name that does not resolve to one is bad usage naming MODEL."""
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as err:
            raise click.BadParameter(f"{spec}: cannot import it ({err})", param_hint="MODEL") from None
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise click.BadParameter(f"{spec}: returned a {type(model).__name__}, not a torch.nn.Module",
                                     param_hint="MODEL")
        return model
    try:
        import torchvision
    except ImportError:
        raise click.BadParameter(f"{spec}: a torchvision model name needs torchvision (pip install "
                                 "'nnkernels[bench]'); or give module:function", param_hint="MODEL") from None
    if spec not in torchvision.models.list_models():
        raise click.BadParameter(f"{spec}: not a torchvision model; e.g. resnet18, resnet50, mobilenet_v3_large",
                                 param_hint="MODEL")
    return torchvision.models.get_model(spec, weights=None)


def in_channels(model: torch.nn.Module) -> int:
    """The channels of the model's input: its first convolution's."""
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    if first is None:
        raise click.BadParameter("the model has no Conv2d: nothing for nnkernels to tune", param_hint="MODEL")
    return first.in_channels


def run(spec, batch_size=32, image_size=224, dtype="bf16", device="auto", channels_last=False, jobs=None):
    """Build `spec`'s model, convert it, and warm up one training step on random images (with a progress bar;
    the convolutions compiled in `jobs` processes first); prints what `convert` swapped and warmup's summary, and
    returns that summary."""
    if device == "auto":
        device = "cpu" if INTERPRETED else "cuda"
    model = load_model(spec)
    images = torch.randn(batch_size, in_channels(model), image_size, image_size)
    model = nnk.convert(model).to(device).train()
    images = images.to(device)
    if channels_last:
        model, images = model.to(memory_format=torch.channels_last), images.to(memory_format=torch.channels_last)
    click.echo(model.nnkernels_summary)
    autocast = torch.autocast(device, dtype=DTYPES[dtype]) if dtype != "fp32" else contextlib.nullcontext()
    with autocast:
        summary = warmup(model, images, progress=True, jobs=jobs)
    click.echo(summary)
    return summary
