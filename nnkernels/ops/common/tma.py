"""What kernels that copy tiles with the tensor memory accelerator (TMA) need at launch.

Their descriptors are made on the device (`tl.make_tensor_descriptor`), in a small global scratch
buffer that Triton asks its allocator for at each launch (`nnkernels.launcher.use_torch_scratch`). TMA
copies need 16-byte aligned bases and 16-byte multiples for every stride but the innermost.
"""
import torch


def check_tma_rows(name: str, channels: int, tensor: torch.Tensor):
    """A channels-last tensor's pixel rows (`channels` elements) must be 16-byte multiples on a
    16-byte aligned base for the TMA."""
    if channels * tensor.element_size() % 16:
        raise ValueError(f"{name}: expected a multiple of {16 // tensor.element_size()} (16-byte rows of "
                         f"{tensor.dtype} for the TMA), got {channels}")
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name}: expected its tensor on a 16-byte aligned address for the TMA, got "
                         f"{tensor.data_ptr():#x}")


def check_box_sides(k, *names: str):
    """Each of the kernel's constants `names` (a TMA box's sides, positive: the kernel object checks that) must be
    a power of two."""
    for name in names:
        side = getattr(k, name)
        if side & (side - 1):
            raise ValueError(f"{name}: expected a power of two, got {side}")
