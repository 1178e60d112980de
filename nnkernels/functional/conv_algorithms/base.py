"""What every convolution algorithm is, and the one rule that picks among them.

An `Algorithm` runs one pass (forward, dx or dw) one way. It says whether it `applies` to a `Problem`, lists
its candidate configs (best guess first) with their `ranks` among the other algorithms of its tier, names the
`kernels` a config launches, in order, and builds a `runner` for a config: a function the plan calls on every
call, with its kernels bound to their grids (`Launcher`s).

A pass is a list of tiers, in order of precedence. The first tier with an algorithm that applies gives the
pass its candidates: every applying algorithm's configs of that tier, merged by rank. Tuning then times a few
of them; most tiers hold one algorithm, so the rules decide and tuning sizes the tiles.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ...launcher import Launcher
from ..common import allocator
from ..common import kernel as cached_kernel


@dataclass(frozen=True)
class GemmConfig:
    """A convolution kernel's tile as the matrix product it computes: BLOCK_M x BLOCK_N outputs, BLOCK_K of the
    reduction per step, its warps and pipeline stages. `split`: slices of the reduction, each summed into its
    own fp32 partial row; `taps`: taps per program (the TMA dw); `m_tiles`: channel tiles per program over one
    whole-reduction tile (the 1x1 kernels; 0: K in slices); `image_pixels`: pixels of one image per tile (the
    channels-last forward; 0: as many as the plane allows)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1
    taps: int = 1
    m_tiles: int = 0
    image_pixels: int = 0


@dataclass(frozen=True)
class Choice:
    """An algorithm (by name) with one of its configs: what tuning times and remembers for a pass."""

    algorithm: str
    config: object


class Algorithm:
    """One way to run one pass of a convolution (see the module docstring)."""

    name: str
    config_type = GemmConfig
    # Whether its runner takes the channels-last copy of its first input (dy for dx and dw), which a backward makes
    # once for both of its passes where both read it.
    channels_last_input = False

    def applies(self, p) -> bool:
        raise NotImplementedError

    def candidates(self, p) -> list:
        raise NotImplementedError

    def ranks(self, p, count: int) -> list[float]:
        """Where this algorithm's candidates stand among its tier's: by default in list order, first."""
        return list(range(count))

    def kernels(self, p, config) -> list:
        raise NotImplementedError

    def runner(self, p, config):
        raise NotImplementedError


_BY_NAME: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in _BY_NAME:
        raise ValueError(f"algorithm: a convolution algorithm named {algorithm.name!r} exists already")
    _BY_NAME[algorithm.name] = algorithm
    return algorithm


def algorithm_named(name: str) -> Algorithm:
    return _BY_NAME[name]


def decode_choice(stored: dict) -> Choice:
    """A stored choice (`dataclasses.asdict` of a `Choice`) read back; KeyError/TypeError where it is not one."""
    algorithm = _BY_NAME[stored["algorithm"]]
    config = stored["config"]
    names = {f.name for f in fields(algorithm.config_type)}
    if set(config) - names:
        raise TypeError(f"unknown config fields {sorted(set(config) - names)} for {algorithm.name}")
    return Choice(algorithm.name, algorithm.config_type(**config))


def tier_choices(tiers, p) -> list[Choice]:
    """The candidates of the first tier in which an algorithm applies to `p`, merged by rank (stable)."""
    for tier in tiers:
        ranked = []
        for algorithm in tier:
            if algorithm.applies(p):
                configs = algorithm.candidates(p)
                ranked += [(rank, index, Choice(algorithm.name, config)) for index, (rank, config)
                           in enumerate(zip(algorithm.ranks(p, len(configs)), configs))]
        if ranked:
            return list(dict.fromkeys(choice for _, _, choice in sorted(ranked, key=lambda r: r[:2])))
    raise ValueError("no convolution algorithm applies")


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def clamp_pow2(n: int, low: int, high: int) -> int:
    return max(low, min(high, pow2_at_least(n)))


def pow2_dividing(n: int) -> int:
    return n & -n


def one_launch_forward(p, kernel, sizes):
    """The runner of a forward that is one launch of `kernel`, arguments (x, weight, bias, y, *sizes): run(x, weight,
    bias) -> y, allocated on every call (without a bias, y stands in its place: the kernel reads it only with
    HAS_BIAS)."""
    new, launch, shape = allocator(p.dtype, p.device), Launcher(kernel), p.y_shape

    def run(x, weight, bias):
        y = new(*shape)
        launch(x, weight, y if bias is None else bias, y, *sizes)
        return y

    return run


def one_launch_dx(p, kernel, sizes):
    """The runner of a dx that is one launch of `kernel`, arguments (dy, weight, dx, *sizes): run(dy, weight, dy_cl)
    -> dx, allocated on every call."""
    new, launch, shape = allocator(p.dtype, p.device), Launcher(kernel), p.x_shape

    def run(dy, weight, dy_cl):
        dx = new(*shape)
        launch(dy, weight, dx, *sizes)
        return dx

    return run


def make_kernel(cls, constants, p, config=None, *, num_warps=None, num_stages=None):
    """The kernel object of class `cls` with `constants`, in p's dtype, with config's warps and stages."""
    if config is not None:
        num_warps, num_stages = config.num_warps, config.num_stages
    return cached_kernel(cls, *constants, dtype=p.dtype, num_warps=num_warps, num_stages=num_stages)
