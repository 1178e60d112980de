"""Block sizes per shape: a heuristic first guess, refined on the GPU by timing a small config set.

`choose(kind, key, candidates, run)` returns one of the configs `candidates()` lists (`Config`s, the
heuristic's guess first). It times them only when all of these hold: the process runs Triton
compiled (the interpreter gets the heuristic, which there means few, large programs), tuning is
not switched off (`NNKERNELS_TUNE=off`), and the current CUDA stream is not capturing a graph
(timing would break the capture). Choices are remembered in memory and in
`$NNKERNELS_CACHE_DIR/tuning.json` (default `~/.cache/nnkernels/tuning.json`), keyed by the kind,
the shape, the GPU, the Triton version and a hash of the library's kernel sources, so each shape is
tuned once per machine and again after a kernel changes (a choice timed on older code is not reused).

Cost bound: candidates are tried in order and no new one is started once 2 s have passed since
`choose` began on this kind and shape, so each costs at most about 2 s plus one compilation (Triton
keeps compiled kernels in its own disk cache, so a config compiles once per machine). A pooling or
batch-norm pass tunes one kind; a convolution's forward one and its backward two (dx, dw).
`NNKERNELS_TUNE=quick` (the default) tries the first three candidates, `full` all of them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .kernel import INTERPRETED

TUNING_BUDGET_S = 2.0
# Above the H200's boost clock, so the GPU's sleep in `_time_ms` lasts at least as long as asked.
GPU_CYCLES_PER_S = 2.0e9
QUICK_CANDIDATES = 3
# Output planes up to this many pixels (14x14) try `Conv2dTmaForward`'s boxes first (tma_forward_candidates).
TMA_FORWARD_FIRST_PIXELS = 256
# 1x1 products reducing over at most this many channels load the whole reduction once (pointwise_candidates).
WHOLE_K_CHANNELS = 64
DEPTHWISE_LANES = 128  # (plane, column) pairs of a depthwise program on the GPU: one per thread of 4 warps
DEPTHWISE_BAND = 16  # most rows of a depthwise program's band
REDUCE_TILE = 8192  # fp32 values one dw-reduce program loads at once: 64 per thread of its 4 warps
DEPTHWISE_DW_SPLIT = 1024  # most fp32 partial rows of the depthwise dw (each C*(KH*KW+1) floats)
_log = logging.getLogger("nnkernels")
_lock = threading.Lock()
_memory: dict | None = None
# (kind, key, device index) -> the Config `choose` answered with, emptied whenever `_memory` is read in again:
# a remembered choice then costs one lookup. Building its full key took 19 µs of an eager step's host time
# on the H200 machine, and a convolution's forward + backward asks three times.
_chosen: dict = {}


@dataclass(frozen=True)
class Config:
    """Tile sizes and launch options of one kernel launch; `split` only for split reductions, `taps`
    only for kernels that take several taps per program."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1
    taps: int = 1  # taps per program, for kernels that reuse one tile for several
    tma: bool = False  # the channels-last forward's tiles as TMA boxes (`Conv2dTmaForward`)
    m_tiles: int = 0  # the 1x1 kernels' channel tiles per program over one whole-reduction x tile (0: K in slices)
    image_pixels: int = 0  # the channels-last forward's pixels of one image per tile (0: `image_tile`'s choice)
    winograd: bool = False  # Winograd F(2x2, 3x3) (`functional.winograd`), these the products' tiles


def mode() -> str:
    """`NNKERNELS_TUNE`: "off" (heuristic only), "quick" (default) or "full"."""
    value = os.environ.get("NNKERNELS_TUNE", "quick").lower()
    if value not in ("off", "quick", "full"):
        raise ValueError(f"NNKERNELS_TUNE: expected one of off, quick, full, got {value!r}")
    return value


def cache_path() -> Path:
    root = os.environ.get("NNKERNELS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nnkernels")
    return Path(root) / "tuning.json"


def _stored() -> dict:
    global _memory
    if _memory is None:
        try:
            _memory = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _memory = {}
        _chosen.clear()
    return _memory


def _save(full_key: str, config: Config):
    """Merge one choice into the JSON file (re-read first: other processes may have added theirs)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            on_disk = json.loads(path.read_text())
        except (OSError, ValueError):
            on_disk = {}
        on_disk[full_key] = asdict(config)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(on_disk, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:
        _log.warning("tuning: could not write %s (%s); the choice is kept for this process only", path, error)


@functools.cache
def kernels_fingerprint() -> str:
    """12 hex digits of a hash over the sources of the library's kernels (helpers included)."""
    from .kernel import catalogue

    digest = hashlib.sha256()
    for cls in catalogue():
        if cls.__module__.startswith("nnkernels."):
            digest.update(cls._kernel_source.encode())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def device_properties(index: int):
    """`torch.cuda.get_device_properties(index)` (name, SM count, compute capability), asked once per GPU:
    torch answers in 6.2 µs a call on the H200 machine (measured through `get_device_name`), and every
    tuned launch (its choice's key holds the name), backward and reduce tile reads one of them."""
    return torch.cuda.get_device_properties(index)


def _full_key(kind: str, key) -> str:
    import triton

    device = device_properties(torch.cuda.current_device()).name if torch.cuda.is_available() else "cpu"
    return f"{kind}|{key}|{device}|triton {triton.__version__}|kernels {kernels_fingerprint()}"


def _time_ms(run, config) -> float:
    """GPU ms of one `run(config)`, the mean over enough back-to-back calls to fill about 10 ms.

    Most of these kernels take less GPU time than Python takes to launch them, so calls timed as
    they are enqueued measure the launch overhead, the same for every config (measured on the
    H200: every forward config of r50 64@56 read ~0.07 ms, where the kernel takes 0.03). So the
    GPU first sleeps for longer than the calls take to enqueue; they then run back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    run(config)
    torch.cuda.synchronize()
    one_call_s = time.perf_counter() - began  # enqueue + GPU time: bounds the enqueue time
    reps = max(1, min(50, int(0.010 / max(one_call_s, 1e-5))))
    torch.cuda._sleep(int(GPU_CYCLES_PER_S * 2 * one_call_s * reps))
    start.record()
    for _ in range(reps):
        run(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def choose(kind: str, key, candidates: Callable[[], list[Config]], run) -> Config:
    """The config to launch `kind` with on shape `key` (see the module docstring).

    `candidates()` lists the configs, the heuristic's first. It is called only where no remembered
    choice answers: some of the GPU's lists take more Python to build than their launch takes to check
    (79 µs for a 3x3 layer's forward list on the 2-core CPU), which an eager training loop would pay on
    every call.
    `run(config)` must launch the kernel(s) on the real tensors with `config`; it is called
    only while tuning, and must leave correct results (every call rewrites the outputs).
    """
    if INTERPRETED or mode() == "off":
        return candidates()[0]
    chosen_key = (kind, key, torch.cuda.current_device() if torch.cuda.is_available() else -1)
    with _lock:
        _stored()  # reads the file in on first use, forgetting `_chosen`
        chosen = _chosen.get(chosen_key)
    if chosen is not None:
        return chosen
    full_key = _full_key(kind, key)
    with _lock:
        stored = _stored().get(full_key)
    if stored is not None:
        chosen = _chosen[chosen_key] = Config(**stored)
        return chosen
    listed = candidates()
    heuristic = listed[0]
    if len(listed) == 1 or torch.cuda.is_current_stream_capturing():
        return heuristic
    tried = listed if mode() == "full" else listed[:QUICK_CANDIDATES]
    began = time.perf_counter()
    timings = {}
    for config in tried:
        if timings and time.perf_counter() - began > TUNING_BUDGET_S:
            break
        try:
            run(config)  # compiles, and warms the caches
            timings[config] = _time_ms(run, config)
        except Exception as error:  # a config the GPU cannot hold (shared memory, registers, or scratch memory:
            # Winograd's fp32 matrices are four times the activations) just drops out
            too_big = (isinstance(error, torch.cuda.OutOfMemoryError) or "OutOfResources" in type(error).__name__
                       or "out of resource" in str(error))
            if not too_big:
                raise
            _log.debug("tuning %s %s: %s does not fit (%s)", kind, key, config, error)
    best = min(timings, key=timings.get) if timings else heuristic
    if timings:
        run(best)  # leave the outputs as the chosen config writes them
    _log.debug("tuning %s %s: %s", kind, key, {str(c): round(t, 4) for c, t in timings.items()})
    with _lock:
        _stored()[full_key] = asdict(best)
        _chosen[chosen_key] = best
    _save(full_key, best)
    return best


# ---- The config sets: the heuristic's guess first, then the alternatives tuning may time. ----

def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _clamp_pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, pow2_at_least(n)))


def _num_sms() -> int:
    if not torch.cuda.is_available():
        return 1
    return device_properties(torch.cuda.current_device()).multi_processor_count


def gemm_candidates(m: int, n: int, k: int, dtype: torch.dtype) -> list[Config]:
    """Configs for an implicit GEMM with M = pixels, N = channels, K = reduction (forward, dx).

    Interpreter: one program over (nearly) all pixels and channels, so the launch has few programs.
    GPU: 128 x N-tile x K-slice tiles with 4 warps (the usual Hopper wgmma shape), K-slices of
    64 bytes of fp32 or 128 bytes of 16-bit data; the alternatives vary the pixel tile (64, 256),
    the K slice and the pipeline depth. The order is what tuning found on the H200 (the
    nnkernels.bench.conv2d layers): the 64-pixel tile and the narrow K slice were the best or
    within 5% of it on most layers, so quick tuning tries them right after the first guess.
    """
    block_n = _clamp_pow2(n, 16, 128)
    if INTERPRETED:
        return [Config(_clamp_pow2(m, 16, 4096), block_n, _clamp_pow2(k, 16, 128), 4, 1)]
    wide = 64 if dtype != torch.float32 else 32
    block_k = _clamp_pow2(k, 16, wide)
    narrow = max(16, block_k // 2)
    configs = [
        Config(128, block_n, block_k, 4 if block_n <= 64 else 8, 3),
        Config(64, block_n, block_k, 4, 4),
        Config(128, block_n, narrow, 4, 4),
        Config(256, block_n, block_k, 8, 3),
        Config(128, _clamp_pow2(n, 16, 256), block_k, 8, 3),
        Config(256, block_n, narrow, 8, 4),
    ]
    return list(dict.fromkeys(configs))


def rows_forward_candidates(ow: int, c_out: int, kw: int, dtype: torch.dtype) -> list[Config]:
    """Configs for `Conv2dRowsForward`: block_m columns of one output row, block_n output channels, K slices
    (block_k) of whole input rows, each `pow2_at_least(kw)` taps wide.

    Interpreter: the whole row and all channels in one program. GPU: the order is what tuning found on the
    H200 for the stem (B32 3->64 7x7 s2 @224, µs): 16-bit, 64 columns, two rows a slice, 4 warps, 2 stages
    124.5, a 128-column tile with four rows 125.9 (the general kernel's best 163.6); full fp32 (three TF32
    products, more registers), 64 columns with 2 warps 346.4, eight rows a slice at 4 warps 366.9, where
    4-warp tiles of 128 columns took 463 to 834 (the general kernel's best 414.0)."""
    span = pow2_at_least(kw)
    block_n = _clamp_pow2(c_out, 16, 128)
    rows2, rows4, rows8 = (max(k, span) for k in (16, 32, 64))
    if INTERPRETED:
        return [Config(_clamp_pow2(ow, 16, 1024), block_n, rows2, 4, 1)]
    wide = _clamp_pow2(ow, 16, 128)
    half = max(16, wide // 2)
    if dtype == torch.float32:
        configs = [Config(half, block_n, rows2, 2, 3), Config(half, block_n, rows8, 4, 3),
                   Config(half, block_n, rows2, 2, 2), Config(wide, block_n, rows2, 4, 4)]
    else:
        configs = [Config(half, block_n, rows2, 4, 2), Config(wide, block_n, rows4, 4, 3),
                   Config(wide, block_n, rows2, 4, 4), Config(half, block_n, rows2, 2, 3)]
    return list(dict.fromkeys(configs))


def dw_candidates(m: int, n: int, pixels: int, groups: int, dtype: torch.dtype) -> list[Config]:
    """Configs for the weight gradient: M = C_OUT/G, N = (C_IN/G)*KH*KW, K = pixels, split over K.

    The output is small and K long, so `split` slices K until about two programs per SM run;
    each slice keeps at least four K-steps so the partial sums stay few.
    """
    if INTERPRETED:
        return [Config(_clamp_pow2(m, 16, 64), _clamp_pow2(n, 16, 128), _clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    wide = 64 if dtype != torch.float32 else 32
    configs = []
    for block_m, block_n, block_k, warps, stages, oversubscribe in (
        (64, 64, wide, 4, 3, 2),
        (64, 128, wide, 8, 3, 2),
        (128, 64, wide, 8, 3, 2),
        (64, 64, wide, 4, 4, 4),
        (128, 128, wide, 8, 3, 2),
        (64, 64, wide // 2, 4, 4, 2),
    ):
        block_m = _clamp_pow2(m, 16, block_m)
        block_n = _clamp_pow2(n, 16, block_n)
        tiles = -(-m // block_m) * -(-n // block_n) * groups
        most = max(1, pixels // (4 * block_k))
        split = max(1, min(most, -(-oversubscribe * _num_sms() // tiles)))
        configs.append(Config(block_m, block_n, block_k, warps, stages, split))
    return list(dict.fromkeys(configs))


@dataclass(frozen=True)
class DepthwiseTile:
    """What one program of the depthwise kernels takes: `planes` planes, a band of `rows` rows and
    `block_w` columns of each, with `num_warps` warps."""

    planes: int
    rows: int
    block_w: int
    num_warps: int


def depthwise_tile(planes: int, rows: int, cols: int, row_step: int = 1, channels: int | None = None) -> DepthwiseTile:
    """The depthwise kernels' tile over `planes` planes of `rows` x `cols` pixels (heuristic only:
    they are memory-bound). Up to 64 columns (a row is one run of addresses), then planes to make
    DEPTHWISE_LANES (plane, column) pairs, one per thread. Bands of up to DEPTHWISE_BAND rows, as
    even as the plane allows and a multiple of `row_step` (dx's stride): a band's input rows are
    loaded once and feed every output row that reads them, so long bands load less. Bands are
    halved while there would be fewer than two programs per SM (small problems want parallelism).
    `channels`: a program's planes are channels of one image (dw's), so no more than that many."""
    lanes = 4096 if INTERPRETED else DEPTHWISE_LANES
    block_w = _clamp_pow2(cols, 1, 64)
    planes_per_program = _clamp_pow2(min(planes, channels or planes), 1, max(1, lanes // block_w))
    tiles = -(-planes // planes_per_program) * -(-cols // block_w)
    longest = DEPTHWISE_BAND
    while longest > 2 * row_step and tiles * -(-rows // longest) < 2 * _num_sms():
        longest //= 2
    bands = -(-rows // max(longest, row_step))
    band = -(-rows // bands)
    band = -(-band // row_step) * row_step
    return DepthwiseTile(planes_per_program, band, block_w, max(1, min(4, planes_per_program * block_w // 32)))


def depthwise_dw_split(batch: int, tile: DepthwiseTile, rows: int, cols: int) -> int:
    """Slices of the depthwise dw's work items (image, band, column tile): each item's own slice, up to
    DEPTHWISE_DW_SPLIT slices, so there are many short programs to hide memory latency with while the
    fp32 partial rows (C*(KH*KW+1) floats each) stay small next to dy."""
    if INTERPRETED:
        return 1
    items = batch * -(-rows // tile.rows) * -(-cols // tile.block_w)
    return min(items, DEPTHWISE_DW_SPLIT)


def peek(kind: str, key, candidates: list[Config]) -> Config:
    """The config `choose` would use now, without timing anything: the remembered one or the heuristic."""
    if INTERPRETED or len(candidates) == 1 or mode() == "off":
        return candidates[0]
    with _lock:
        stored = _stored().get(_full_key(kind, key))
    return Config(**stored) if stored is not None else candidates[0]


def _pow2_dividing(n: int) -> int:
    return n & -n


def channels_last_candidates(batch: int, pixels_per_image: int, n: int, c_in: int, dtype: torch.dtype,
                             taps: int = 0, tma_plane: tuple[int, int] | None = None) -> list[Config]:
    """`gemm_candidates` for the channels-last forward and dx kernels. Their pixel tiles take
    `image_tile(block_m, pixels_per_image)` pixels of one image (one phase of one image for dx),
    so on the GPU a tile is no wider than that rounded up to a power of two, and at least the 64
    rows of a Hopper warpgroup MMA (several small images then share a tile); in the interpreter
    tiles span many images, for few programs. K slices must not straddle taps: BLOCK_K divides
    `c_in`, the channels reduced over (C_IN for the forward, C_OUT for dx). When the first guess
    leaves SMs idle (fewer than two programs per SM), narrower channel tiles go first. With `taps`
    (the forward's KH*KW; its K is taps*c_in), a tile set with fewer programs than SMs is also
    offered split over K (`split`: 2 to 4 slices, so about two programs per SM run), right after
    itself: ResNet-50's 512-channel 7x7 layer has 52 tiles of 128 x 128 for 132 SMs.
    The forward on planes of more than TMA_FORWARD_FIRST_PIXELS pixels tries first 64-pixel tiles of several
    images (`image_pixels` = 16 or 32 pixels of each, dividing the plane; where the batch fills one tile at
    least): no ragged tiles, and on 28x28 planes 392 programs for 132 SMs where 128-pixel tiles of one image
    make 224 (7 per image, the last 16 pixels full).
    On the H200 (B32, kernel alone, µs, same run): 128@28 TF32 56.2 -> 39.9, bf16 33.5 -> 24.8; 64@56 (32
    pixels of 2 images) TF32 56.6 -> 53.9, bf16 34.8 -> 32.7 (BENCHMARKS.md, fourteenth session). Full fp32
    (three TF32 products, more registers per tile) wants them 64 channels wide: 128@28 127.0 against 155.7
    for 128 channels and 130.3 for the best TMA box (fifteenth session), so both widths come first.
    With `tma_plane` (the forward's OH, OW, where `Conv2dTmaForward` can run), its boxes of 64 pixels
    by 64 or 128 channels are offered too (`tma_forward_candidates`): first on planes of at most
    TMA_FORWARD_FIRST_PIXELS pixels, where they were faster on the H200, last on larger ones."""
    limit = _pow2_dividing(c_in)
    widest = 4096 if INTERPRETED else max(64, pow2_at_least(pixels_per_image))
    found = [Config(min(c.block_m, widest), c.block_n, min(c.block_k, limit), c.num_warps, c.num_stages)
             for c in gemm_candidates(batch * pixels_per_image, n, c_in, dtype)]
    if not INTERPRETED:
        first = found[0]
        if _pixel_tiles(first, batch, pixels_per_image, n) < 2 * _num_sms() and first.block_n > 64:
            found.insert(0, Config(first.block_m, 64, first.block_k, 4, first.num_stages))
        exact = min(32, _pow2_dividing(pixels_per_image))
        if taps and pixels_per_image > TMA_FORWARD_FIRST_PIXELS and exact >= 16 and batch >= 64 // exact:
            found[:0] = [Config(64, block_n, first.block_k, 4, 3, image_pixels=exact)
                         for block_n in dict.fromkeys((first.block_n, min(first.block_n, 64)))]
        if taps:
            found = [split for config in found
                     for split in _split_k(config, _pixel_tiles(config, batch, pixels_per_image, n), taps * c_in)]
    if tma_plane is not None:
        boxes = tma_forward_candidates(batch, tma_plane, n, c_in, dtype, taps)
        found = boxes + found if tma_plane[0] * tma_plane[1] <= TMA_FORWARD_FIRST_PIXELS else found + boxes
    if INTERPRETED:
        found = found[:1]  # the interpreter gets one config, as from every candidate list
    return list(dict.fromkeys(found))


def tma_forward_candidates(batch: int, plane: tuple[int, int], n: int, c_in: int, dtype: torch.dtype,
                           taps: int) -> list[Config]:
    """Configs of `Conv2dTmaForward` (`tma`): boxes of 64 output pixels (`tma_forward_box`) by BLOCK_N
    channels, one warpgroup, 4 then 3 pipeline stages, each also split over K when its programs are fewer
    than the SMs. What won in a sweep on the H200 (ResNet-50's 3x3 layers, B32, bf16, TF32 and full fp32;
    BENCHMARKS.md, twelfth session): 64-pixel boxes on every layer, 128 channels (64 where C_OUT is),
    4 stages and split K by 2 on 7x7 planes. The interpreter takes one box set over many images."""
    block_n = _clamp_pow2(n, 16, 128)
    block_k = min(64 if dtype != torch.float32 else 32, _pow2_dividing(c_in))
    if INTERPRETED:
        return [Config(4096, block_n, block_k, 4, 1, tma=True)]
    found = []
    for stages in (4, 3):
        config = Config(64, block_n, block_k, 4, stages, tma=True)
        box_b, box_h, box_w = tma_forward_box(config.block_m, *plane)
        programs = -(-batch // box_b) * -(-plane[0] // box_h) * -(-plane[1] // box_w) * -(-n // block_n)
        found += _split_k(config, programs, taps * c_in)
    return found


def tma_forward_box(block_m: int, rows: int, cols: int) -> tuple[int, int, int]:
    """(BOX_B, BOX_H, BOX_W) of `Conv2dTmaForward` for `block_m` pixels (a power of two) of planes of
    rows x cols: whole planes rounded up to powers of two, several images of them where they are
    smaller than `block_m`, else `tma_box`'s box."""
    plane_h, plane_w = pow2_at_least(rows), pow2_at_least(cols)
    if plane_h * plane_w <= block_m:
        return block_m // (plane_h * plane_w), plane_h, plane_w
    return (1, *tma_box(rows, cols, block_m))


def _pixel_tiles(config: Config, batch: int, pixels_per_image: int, n: int) -> int:
    """Programs of a channels-last forward or dx launch with `config` (one split)."""
    per_tile = image_tile(config.block_m, pixels_per_image, config.image_pixels)
    return -(-batch // (config.block_m // per_tile)) * -(-pixels_per_image // per_tile) * -(-n // config.block_n)


def _split_k(config: Config, programs: int, k: int) -> list[Config]:
    """`config`, then, when its `programs` are fewer than the SMs, the same tiles split over K into 2
    to 4 slices (about two programs per SM, each slice at least four K-steps)."""
    if programs >= _num_sms() or k // config.block_k < 8:
        return [config]
    split = max(2, min(4, 2 * _num_sms() // programs, k // config.block_k // 4))
    return [config, replace(config, split=split)]


def image_tile(block_m: int, pixels_per_image: int, image_pixels: int = 0) -> int:
    """BLOCK_Q of the channels-last kernels: the pixels of one image in a tile of `block_m` rows
    (the rest of the tile holds further images); `image_pixels` where a config sets it."""
    return image_pixels or min(block_m, pow2_at_least(pixels_per_image))


def _dw_split(tiles: int, pixels: int, block_k: int, oversubscribe: int) -> int:
    """Pixel slices of a dw launch: about `oversubscribe` programs per SM, each slice at least
    four K-steps long."""
    most = max(1, pixels // (4 * block_k))
    return max(1, min(most, -(-oversubscribe * _num_sms() // tiles)))


def channels_last_dw_candidates(m: int, c_in: int, taps: int, pixels: int, dtype: torch.dtype) -> list[Config]:
    """Configs of the channels-last dw kernel. A column tile either lies inside one tap (BLOCK_N
    divides C_IN) or holds all C_IN channels of BLOCK_N/C_IN taps (small power-of-two C_IN: the
    dy tile is then loaded once for several taps, and the tile reaches the 128 to 256 columns a
    64-channel layer otherwise cannot). For fp32, variants with num_stages=1: TF32 tensor cores
    take operands contiguous along the reduced pixels, these are contiguous along channels, so the
    pipelined copies into shared memory go 4 bytes at a time, where an unpipelined tile is loaded
    16 bytes at a time and transposed on its way into shared memory. The order is what tuning
    found on the H200 (nnkernels.bench.conv2d layers, 2026-12-01): for fp32 the unpipelined tiles
    won on every layer, TF32 or not (r50 256@14 TF32: 221 us against 289 for the best pipelined
    one); for bf16 128 x 64 tiles with 8 warps (64 x 64 where C_OUT is 64), 73 to 82 us against
    78 to 98 for the others. Tiles of several taps did not pay in bf16 (80 against 73 us at
    r50 64@56): the x tile of every tap is still loaded once per tap."""
    limit = _pow2_dividing(c_in)
    if INTERPRETED:
        return [Config(_clamp_pow2(m, 16, 64), min(_clamp_pow2(c_in * taps, 16, 128), limit),
                       _clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    wide = 64 if dtype != torch.float32 else 32
    shapes = [(128, 64, wide, 8, 3, 2), (64, 64, wide, 4, 3, 2), (64, 64, wide, 4, 4, 4), (64, 128, wide, 8, 3, 2),
              (128, 128, wide, 8, 3, 2), (64, 64, wide // 2, 4, 4, 2)]
    if c_in == limit and c_in <= 64:
        shapes += [(64, 2 * c_in, wide, 8, 3, 2), (64, 4 * c_in, wide, 8, 3, 2)]
    if dtype == torch.float32:
        shapes[:0] = [(64, 64, 32, 4, 1, 4), (64, 128, 32, 8, 1, 2), (64, 128, 32, 4, 1, 4)]
    configs = []
    for block_m, block_n, block_k, warps, stages, oversubscribe in shapes:
        block_m = _clamp_pow2(m, 16, block_m)
        if block_n > c_in and c_in == limit:  # several taps, at most four (9 taps: 3 tiles of 4)
            block_n = min(block_n, 4 * c_in)
        else:
            block_n = min(block_n, limit)
        span = max(1, block_n // c_in)
        tiles = -(-m // block_m) * -(-taps // span) * (c_in // (block_n // span))
        configs.append(Config(block_m, block_n, block_k, warps, stages, _dw_split(tiles, pixels, block_k, oversubscribe)))
    return list(dict.fromkeys(configs))


def tma_box(rows: int, cols: int, pixels: int) -> tuple[int, int]:
    """(BOX_H, BOX_W) of `pixels` (a power of two) for planes of rows x cols: the box that wastes the
    least on the planes' ragged edges (56x56: 8x8 boxes fit exactly; 7x7: 8x8 boxes hold 49 of 64),
    the wider one among equals (longer runs of addresses)."""
    def covered(box_w):
        box_h = pixels // box_w
        return -(-rows // box_h) * box_h * -(-cols // box_w) * box_w

    widths = [1 << i for i in range(pixels.bit_length()) if 1 << i <= pixels]
    box_w = min(widths, key=lambda w: (covered(w), -w))
    return pixels // box_w, box_w


def tma_dw_candidates(c_out: int, c_in: int, kh: int, kw: int, batch: int, rows: int, cols: int,
                      dtype: torch.dtype) -> list[Config]:
    """Configs of `Conv2dTmaDw`: BLOCK_M c_out x BLOCK_N c_in tiles, boxes of `block_k` pixels (64
    for 16-bit types, 32 for fp32: 128 bytes of a 64-channel row either way), one tap or a row of
    KW taps per program (one dy box then serves the row), and the boxes split so that a given
    number of programs per SM run: at most that (floor: a second, nearly empty wave of programs
    would double the time). The order is what `tools/conv_dw_sweep.py` found on the H200 (ResNet-50's
    3x3 layers, B32, 2026-12-01; BENCHMARKS.md, sixth session): 128 x 64 tiles of one tap with 3
    programs per SM first (256 and 512 channels: 37 and 43 µs in bf16, 100 and 139 in fp32), then
    rows of taps on 64 x 64 tiles (64 channels: 27 µs in bf16 against 43 for single taps), then
    128 x 128. fp32 with TF32, now three bf16 products (`ops/common/tensor_core.py`), ran fastest (H200,
    2026-12-01, every candidate) on rows of taps over 64 x 64 tiles at 2 programs per SM (64@56: 86 µs),
    on 128 x 128 tiles (128@28 and 256@14: 84 and 96 µs) and on 128 x 64 tiles at 6 per SM (512@7: 119
    µs; 256@14: 97), so its order starts with those three (fp32 with TF32 off too, not timed so)."""
    if INTERPRETED:
        return [Config(_clamp_pow2(c_out, 16, 64), _clamp_pow2(c_in, 16, 64), 64, 4, 1, 1, kw)]
    block_k = 64 if dtype != torch.float32 else 32
    box_h, box_w = tma_box(rows, cols, block_k)
    boxes = batch * -(-rows // box_h) * -(-cols // box_w)
    order = [(128, 64, 8, 3, 1, 3), (64, 64, 4, 3, kw, 2), (128, 128, 8, 3, 1, 1), (128, 64, 8, 3, 1, 6),
             (64, 64, 4, 3, kw, 3), (64, 64, 8, 3, 1, 4)]
    if dtype == torch.float32:
        order = [order[1], order[2], order[3], order[4], order[0], order[5]]
    configs = []
    for block_m, block_n, warps, stages, taps, per_sm in order:
        block_m, block_n = _clamp_pow2(c_out, 16, block_m), _clamp_pow2(c_in, 16, block_n)
        tiles = -(-c_out // block_m) * -(-c_in // block_n) * (kh * kw // taps)
        split = max(1, min(boxes, per_sm * _num_sms() // tiles))
        configs.append(Config(block_m, block_n, block_k, warps, stages, split, taps))
    return list(dict.fromkeys(configs))

def reduce_tile(positions: int, taps: int = 1) -> tuple[int, int, int]:
    """(TAP_BLOCK, SPLIT_ROWS, BLOCK) of the dw reduce over `positions` = N_DW / taps, all taps of
    BLOCK positions per program. BLOCK: enough programs for two per SM, 128 to 1024 // TAP_BLOCK
    positions (at least 128); each program sums SPLIT rows group after group, latency-bound
    (measured 11 us for 36 programs of 1024 on the H200); the interpreter takes the widest.
    SPLIT_ROWS: split rows loaded at once, REDUCE_TILE values in all (one row past 64 taps), up to
    64. Measured on the H200: the 1x1 layer's reduce (programs of 128 values) took 11 us 8 rows at
    a time, 6 us 64; 512 x 512 x 9 tap-major values took 4x longer than the 1-D reduce before in
    tiles of 9 taps x 64 positions (8 rows), 1.8x less in tiles of 9 x 128 (4 rows)."""
    tap_block = pow2_at_least(taps)
    high = max(128, 1024 // tap_block)
    block = high if INTERPRETED else _clamp_pow2(positions // (2 * _num_sms()), 128, high)
    return tap_block, _clamp_pow2(REDUCE_TILE // (tap_block * block), 1, 64), block


def pointwise_candidates(c_out: int, c_in: int, pixels: int, dtype: torch.dtype, tf32: bool) -> list[Config]:
    """Tiles of the 1x1 kernels (forward; dx swaps c_out and c_in): BLOCK_M channels x BLOCK_N
    pixels x BLOCK_K reduced channels. First guess: 128-pixel rows keep loads wide, K slices of
    128 bytes (64 bytes for fp32); the others vary the pixel tile, the warps and the pipeline. A
    tile's pixels are one image's, so planes under 128 pixels get rows of their own size (ResNet-50's
    7x7 layers ran at 0.43x cuDNN's speed on the H200 with 128-pixel rows, 49 of them used), and
    wider channel tiles instead of the 256-pixel rows. For full fp32 (FMA products) also
    num_stages=1, and the 64-channel tile 4 stages deep first (the order that served fp32 when the TF32
    path also took these tiles). Where the reduction is at most WHOLE_K_CHANNELS channels, a program loads it as one
    tile for all its output channels (`m_tiles`), which goes first: on the H200 64->256 @56 took 29.3
    µs in bf16 against the others' best 34.6, 64 -> 147 rows @112 83.3 against 131.2. fp32 with TF32
    (`tf32`, TF32 products from registers) has its own list, `_pointwise_tf32_candidates`. The
    interpreter gets one program per image."""
    if INTERPRETED:
        block_m = _clamp_pow2(c_out, 16, 128)
        whole_k = -(-c_out // block_m) if c_in <= WHOLE_K_CHANNELS else 0
        return [Config(block_m, _clamp_pow2(pixels, 16, 4096), _clamp_pow2(c_in, 16, 128), 4, 1, m_tiles=whole_k)]
    if dtype == torch.float32 and tf32:
        return _pointwise_tf32_candidates(c_out, c_in, pixels)
    block_m = _clamp_pow2(c_out, 16, 128)
    block_k = _clamp_pow2(c_in, 16, 32 if dtype == torch.float32 else 64)
    warps = 8 if block_m >= 128 else 4
    row = _clamp_pow2(pixels, 16, 128)
    wider = (Config(block_m, 256, block_k, 8, 3) if row == 128
             else Config(_clamp_pow2(c_out, 16, 256), row, block_k, 8, 3))
    configs = [Config(block_m, row, block_k, warps, 3), wider, Config(_clamp_pow2(c_out, 16, 64), row, block_k, 4, 4)]
    if dtype == torch.float32:
        configs[1:1] = [Config(block_m, row, block_k, warps, 1), Config(_clamp_pow2(c_out, 16, 64), row, block_k, 4, 1)]
        configs.insert(0, configs.pop())  # the 64-channel tile, 4 stages
    if c_in <= WHOLE_K_CHANNELS:
        block_m = _clamp_pow2(c_out, 16, 64)
        configs.insert(0, Config(block_m, row, pow2_at_least(max(16, c_in)), 4, 1, m_tiles=-(-c_out // block_m)))
    return list(dict.fromkeys(configs))


def _pointwise_tf32_candidates(c_out: int, c_in: int, pixels: int) -> list[Config]:
    """`pointwise_candidates` for fp32 with TF32: [pixels, channels] products whose register operand is the
    x tile, 64 pixels first. On the H200 (B32; the best of 36 and of 18 configs): 256->64 @56 40.8 µs at 64
    pixels, K slices of 64, 2 stages (41.2 with slices of 32, 41.9 at 4 stages, 42.0 at 128 pixels); over
    a whole reduction of 64, 64->256 @56 46.5 at 64 pixels and 64 channels (48.0 at 128 pixels, 50.6 at
    32 channels), 64 -> 147 rows @112 104.9 at 32 channels (107.7 at 64, 108.4 at 128 pixels)."""
    row = _clamp_pow2(pixels, 16, 64)
    wide_row = _clamp_pow2(pixels, 16, 128)
    block_m = _clamp_pow2(c_out, 16, 64)
    if c_in <= WHOLE_K_CHANNELS:
        block_k = pow2_at_least(max(16, c_in))
        narrow = _clamp_pow2(c_out, 16, 32)
        configs = [Config(block_m, row, block_k, 4, 1, m_tiles=-(-c_out // block_m)),
                   Config(narrow, row, block_k, 4, 1, m_tiles=-(-c_out // narrow)),
                   Config(block_m, wide_row, block_k, 4, 1, m_tiles=-(-c_out // block_m))]
    else:
        configs = [Config(block_m, row, _clamp_pow2(c_in, 16, 64), 4, 2), Config(block_m, row, 32, 4, 4),
                   Config(block_m, wide_row, 32, 4, 3), Config(_clamp_pow2(c_out, 16, 128), wide_row, 64, 8, 3)]
    return list(dict.fromkeys(configs))


def rows_outer_dw_candidates(c_out: int, rows: int, pixels: int, dtype: torch.dtype) -> list[Config]:
    """Tiles and split of the weight gradient as one 1x1 product over `pixels` (rows-outer unfolded
    columns): C_OUT x rows tiles, the split as `pointwise_dw_candidates` sets it and larger, since the
    products are few per program. On the H200 (ResNet-50's 512@7, B32) the TF32 product and its sum
    took 64 µs in 128 x 128 tiles at split 3, 76 at split 1; full fp32 139 µs in 128 x 64 tiles at
    split 4, 177 at split 1. The first three (quick tuning's) hold full fp32's best there and a TF32
    tile within 5% of TF32's."""
    if INTERPRETED:
        return pointwise_dw_candidates(c_out, rows, pixels, 1, dtype)
    block_k = 64 if dtype != torch.float32 else 32
    steps = -(-pixels // block_k)

    def tile(block_m, block_n, warps, stages, splits):
        block_m, block_n = _clamp_pow2(c_out, 16, block_m), _clamp_pow2(rows, 16, block_n)
        split = -(-2 * _num_sms() // (-(-c_out // block_m) * -(-rows // block_n)))
        return [Config(block_m, block_n, block_k, warps, stages, max(1, min(split * k, steps // 4))) for k in splits]

    square, wide = tile(128, 128, 8, 3, (1, 2)), tile(128, 64, 4, 3, (4, 1, 2))
    configs = [square[0], wide[0], square[1], *wide[1:], *tile(64, 128, 4, 3, (1,)), *tile(64, 64, 4, 4, (1,))]
    return list(dict.fromkeys(configs))


def pointwise_dw_candidates(c_out: int, c_in: int, pixels: int, batch: int, dtype: torch.dtype) -> list[Config]:
    """Tiles and split of the 1x1 weight gradient: C_OUT x C_IN tiles, the B*HW pixels split until
    about two programs per SM run (four for the smaller tiles), each slice keeping at least four
    steps. Both operands are pixel-contiguous, as every tensor-core type wants them."""
    if INTERPRETED:
        return [Config(_clamp_pow2(c_out, 16, 64), _clamp_pow2(c_in, 16, 128), _clamp_pow2(pixels, 16, 4096), 4, 1, 1)]
    block_k = 64 if dtype != torch.float32 else 32
    configs = []
    for block_m, block_n, warps, stages, oversubscribe in ((64, 128, 4, 3, 2), (128, 128, 8, 3, 2), (64, 64, 4, 4, 4),
                                                           (64, 128, 8, 3, 2)):
        block_m, block_n = _clamp_pow2(c_out, 16, block_m), _clamp_pow2(c_in, 16, block_n)
        tiles = -(-c_out // block_m) * -(-c_in // block_n)
        steps = batch * -(-pixels // block_k)
        split = max(1, min(-(-oversubscribe * _num_sms() // tiles), steps // 4))
        configs.append(Config(block_m, block_n, block_k, warps, stages, split))
    return list(dict.fromkeys(configs))


def winograd_candidates(rows: int, channels: int) -> list[Config]:
    """Tiles of the Winograd forward's 16 products (`Conv2dWinogradProducts`: `rows` output channels by T
    tiles, reducing over `channels`). On the H200 (B32, full fp32, nineteenth session, µs per the 16 products):
    128@28 128 x 64 70.0, 64 x 64 71.1, 64 x 128 72.1, 128 x 128 (8 warps) 72.2; 256@14 68.4, -, 72.2, 75.6;
    64@56 (64 rows) 64 x 64 88.7, 64 x 128 90.3, 128 x 64 146.5. The interpreter takes one large tile."""
    if INTERPRETED:
        return [Config(_clamp_pow2(rows, 16, 64), 64, _clamp_pow2(channels, 16, 64), 4, 1, winograd=True)]
    configs = [Config(128, 64, 32, 4, 4, winograd=True)] if rows >= 128 else []
    configs += [Config(64, 64, 32, 4, 4, winograd=True), Config(64, 128, 32, 4, 4, winograd=True),
                Config(128, 128, 32, 8, 3, winograd=True)]
    return configs


def winograd_dw_candidates(c_out: int, c_in: int, tiles: int) -> list[Config]:
    """Tiles and split of the Winograd weight gradient's 16 products (c_out x c_in, reducing over the T
    `tiles`), split until about two programs per SM run (`_dw_split`). On the H200 (B32, full fp32,
    nineteenth session, µs): 128@28 128 x 64 split 8 55.3, split 16 61.6, split 4 74.7; 64@56 64 x 64 split
    16 71.3; 256@14 128 x 64 split 2 54.1, split 4 59.0."""
    if INTERPRETED:
        return [Config(_clamp_pow2(c_out, 16, 64), _clamp_pow2(c_in, 16, 64), 64, 4, 1, 2, winograd=True)]
    tiles_tried = ((128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3)) if c_out >= 128 else ((64, 64, 4, 4),
                                                                                            (64, 128, 4, 4))
    configs = []
    for block_m, block_n, warps, stages in tiles_tried:
        programs = -(-c_out // block_m) * -(-c_in // block_n) * 16
        configs.append(Config(block_m, block_n, 32, warps, stages, _dw_split(programs, tiles, 32, 2), winograd=True))
    return list(dict.fromkeys(configs))
