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
NARROWEST_CHANNELS = 8  # 16 bytes of bf16: one vector
MOST_IDLE_CHANNELS = 1 / 4  # of the channels, the most the last channel tile may leave idle past them


@dataclass(frozen=True)
class ChannelsLastTile:
    """A program's BLOCK_P pixels by BLOCK_C channels, with `num_warps` warps."""

    block_p: int
    block_c: int
    num_warps: int


def channel_widths(channels: int) -> list[int]:
    """BLOCK_C for `channels` channels: as many as a pixel has up to WIDEST_CHANNELS, and where their tiles would
    leave more than MOST_IDLE_CHANNELS of the channels idle, first the widest narrower one (NARROWEST_CHANNELS at
    least) that does not, or else the narrowest (72 channels: 16-channel tiles, 80 lanes, before 64-channel ones,
    128 lanes with 56 idle)."""
    widest = width = min(next_power_of_2(channels), WIDEST_CHANNELS)
    while width > NARROWEST_CHANNELS and -(-channels // width) * width > channels * (1 + MOST_IDLE_CHANNELS):
        width //= 2
    return list(dict.fromkeys((width, widest)))


def nhwc_tiles(pixels: int, channels: int, machine) -> list[ChannelsLastTile]:
    """Tiles over `pixels` pixels of `channels` channels: each of `channel_widths(channels)` channels by pixels up
    to GPU_TILES[0] elements, then by pixels up to each of the other GPU_TILES (so quick tuning times both widths);
    the interpreter: one large tile of the first width."""
    widths = channel_widths(channels)
    if not machine.gpu:
        return [ChannelsLastTile(max(1, min(INTERPRETER_TILE // widths[0], next_power_of_2(pixels))), widths[0], 4)]
    shapes = [(GPU_TILES[0], width) for width in widths] + [(size, widths[0]) for size in GPU_TILES[1:]]
    found = [ChannelsLastTile(max(1, min(size // width, next_power_of_2(pixels))), width, 4) for size, width in shapes]
    return list(dict.fromkeys(found))
