"""Integer helpers for grids and tiles on the host, where the launchers run them on every call.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions (3.6 and 3.9): each host
call goes through their argument unwrapping, which costs far more than the arithmetic, and a
convolution's forward + backward makes dozens of them (docs/notes.md, "Host time").
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as `triton.cdiv`."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def power_of_2_at_most(n: int) -> int:
    """The largest power of two <= n, for n >= 1."""
    return 1 << (n.bit_length() - 1)


def channel_alignment(channels: int, itemsize: int) -> int:
    """C_ALIGN of the channels-last kernels, what the compiler is told of the channel count C so that each pixel's
    channels load as vectors: 1 where C is a multiple of 16 (Triton's specialisation of a launch's integers tells
    it so already), else the largest power of two dividing C, at most 16 bytes of channels."""
    if channels % 16 == 0:
        return 1
    return min(channels & -channels, max(1, 16 // itemsize))
