"""What the ops' candidate lists read of the machine a call runs on: `machine_of(device)`.

A compiled process runs the kernels on a GPU, and candidate configs are sized for its SMs; an interpreted
process runs them on the CPU, where few, large programs are fastest. One `Machine` per device, asked of
torch once, since asking torch costs host time on every call (docs/notes.md, "Host time").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._mode import INTERPRETED


@dataclass(frozen=True)
class Machine:
    """`gpu`: compiled on a GPU (else Triton's interpreter); `sms`: its multiprocessors; `tma`: whether kernels
    copying TMA boxes run (compute capability 9.0 and up; the interpreter runs them too); `name`: the GPU's
    name, which keys remembered tuning choices."""

    gpu: bool
    sms: int
    tma: bool
    name: str


INTERPRETER = Machine(gpu=False, sms=1, tma=True, name="cpu")


@functools.lru_cache(maxsize=None)
def device_properties(index: int):
    """`torch.cuda.get_device_properties(index)`, asked once per GPU."""
    return torch.cuda.get_device_properties(index)


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> Machine:
    properties = device_properties(index)
    return Machine(gpu=True, sms=properties.multi_processor_count, tma=(properties.major, properties.minor) >= (9, 0),
                   name=properties.name)


def machine_of(device: torch.device) -> Machine:
    """The machine a call on `device` runs on: the interpreter for CPU tensors (and meta ones), else its GPU."""
    if INTERPRETED or device.type != "cuda":
        return INTERPRETER
    return _gpu(device.index if device.index is not None else torch.cuda.current_device())
