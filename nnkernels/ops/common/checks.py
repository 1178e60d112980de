"""Size and grid checks shared by the kernels' launchers: each names the argument and what was expected."""
from ...kernel import INT32_MAX

GRID_AXIS_MAX = 65535  # CUDA's limit on grid axes 1 and 2


def check_numel(name, tensor, expected, formula):
    if tensor.numel() != expected:
        raise ValueError(f"{name}: expected {formula} = {expected} elements, got {tensor.numel()}")


def check_output_size(name, got, size, kernel, stride, pad, size_name, k_name, stride_name, pad_name):
    """`got` must equal (size + 2*pad - kernel) // stride + 1, which must be >= 1."""
    if size + 2 * pad < kernel:
        raise ValueError(
            f"{size_name}: padded input size {size} + 2*{pad_name} = {size + 2 * pad} is smaller than "
            f"{k_name} = {kernel}"
        )
    expected = (size + 2 * pad - kernel) // stride + 1
    if got != expected:
        raise ValueError(
            f"{name}: expected ({size_name} + 2*{pad_name} - {k_name}) // {stride_name} + 1 = {expected}, got {got}"
        )


def check_grid(num_programs):
    if num_programs > INT32_MAX:
        raise ValueError(f"grid: {num_programs} programs exceed the 2**31 - 1 that one grid axis holds")
    return (num_programs,)


def check_grid_3d(axis0, axis1, axis2):
    """A 3-axis grid; axes 1 and 2 must fit CUDA's 65535."""
    for name, value in (("grid axis 1", axis1), ("grid axis 2", axis2)):
        if value > GRID_AXIS_MAX:
            raise ValueError(f"{name}: {value} programs exceed the {GRID_AXIS_MAX} that CUDA allows")
    return (check_grid(axis0)[0], axis1, axis2)


def check_channel_alignment(c_align: int, channels: int, name: str = "C_ALIGN", count: str = "C"):
    """A kernel's C_ALIGN (`host_math.channel_alignment`; `name` another such constant) must be a power of two
    dividing its C channels (`count` the size it is of)."""
    if c_align < 1 or c_align & (c_align - 1) or channels % c_align:
        raise ValueError(f"{name}: expected a power of two dividing {count} = {channels}, got {c_align}")
