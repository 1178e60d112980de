"""`channels_last(t)`: the NHWC copy of an NCHW tensor that the channels-last convolution kernels read.

`t.permute(0, 2, 3, 1).contiguous()`, bit for bit, by the tile-transpose kernel `ChannelsLastCopy`
(measured on the H200: 36 us for PyTorch's copy of a B32 C64 56x56 bf16 tensor, 11 us for the
tile transpose). Each launch is logged at DEBUG level on the "nnkernels" logger, like the ops'.
"""
import logging

import torch

from ..kernel import DTYPE_NAMES
from ..ops.layout import channels_last_kernel, channels_last_tiles

_log = logging.getLogger("nnkernels")


def channels_last(t):
    """`t.permute(0, 2, 3, 1).contiguous()` for a contiguous [N, C, H, W] tensor, by `ChannelsLastCopy`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"t: expected a 4-D [N, C, H, W] tensor, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"t: expected dtype torch.float32, torch.float16 or torch.bfloat16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous tensor, got strides {tuple(t.stride())}")
    n, c, h, w = t.shape
    y = torch.empty((n, h, w, c), dtype=t.dtype, device=t.device)
    if y.numel():
        kernel = channels_last_kernel(*channels_last_tiles(c, h * w), t.dtype)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("layout launches %s", kernel.id)
        kernel.launch(t, y, n, c, h * w)
    return y
