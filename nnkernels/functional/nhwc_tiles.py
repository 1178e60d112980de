"""The tiles of the kernels that take a block of pixels by a run of channels of a channels-last tensor
(depthwise convolution and average pooling): their config type and candidates."""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.common.host_math import next_power_of_2

# Elements of a program's [BLOCK_P, BLOCK_C] tile on the GPU (each a first guess, then the others), and in the
# interpreter, which pays per program.
GPU_TILES = (2048, 1024, 4096)
INTERPRETER_TILE = 2**15
WIDEST_CHANNELS = 64  # channels of a pixel one program reads: 128 bytes of bf16


@dataclass(frozen=True)
class ChannelsLastTile:
    """A program's BLOCK_P pixels by BLOCK_C channels, with `num_warps` warps."""

    block_p: int
    block_c: int
    num_warps: int


def nhwc_tiles(pixels: int, channels: int, machine) -> list[ChannelsLastTile]:
    """Tiles over `pixels` pixels of `channels` channels: as many channels as a pixel has up to WIDEST_CHANNELS,
    then pixels up to each of GPU_TILES elements (the interpreter: one large tile)."""
    block_c = min(next_power_of_2(channels), WIDEST_CHANNELS)
    sizes = GPU_TILES if machine.gpu else (INTERPRETER_TILE,)
    found = [ChannelsLastTile(max(1, min(size // block_c, next_power_of_2(pixels))), block_c, 4) for size in sizes]
    return list(dict.fromkeys(found))
