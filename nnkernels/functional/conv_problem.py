"""`Problem`: one convolution's sizes in the names the kernels take, and the facts about it that decide which
algorithms may run its passes (`conv_algorithms`). The thresholds are where one algorithm overtook another on
the H200; docs/notes.md has the measurements.
"""
from __future__ import annotations

import os

import torch

from ..machine import Machine
from ..ops.conv2d.winograd_transforms import POINTS, tiles_of

# The channels-last kernels read K slices of 16 channels.
CHANNELS_LAST_MULTIPLE = 16
# The fewest channels a channels-last problem's masked K slices take (at least half of a 16-channel slice).
MASKED_SLICE_MIN_CHANNELS = 8
# The unfolded backward (1x1 products over the C_IN*KH*KW rows of the unfolded input) is for few input channels
# and large planes, the RGB stem's: there the implicit GEMM's C_IN tile is mostly padding.
UNFOLD_MAX_CHANNELS = 4
UNFOLD_MIN_PIXELS = 1024
# fp32 weight gradients of small planes (larger ones with TF32 off) are one 1x1 product over B*OH*OW pixels of
# the input unfolded rows-outer: a reduction the tensor cores read in contiguous runs.
UNFOLD_DW_MAX_PIXELS = 256
UNFOLD_DW_MAX_PIXELS_FULL_FP32 = 4096
# Winograd F(2x2, 3x3) is offered for full-fp32 3x3 stride-1 pad-1 layers with this many channels in and out:
# with fewer the products are too thin for the transforms' traffic to pay.
WINOGRAD_MIN_CHANNELS = 64


def output_size(size, kernel, stride, pad, dilation):
    """An output side of a convolution, as torch computes it."""
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def winograd_enabled():
    """`NNKERNELS_WINOGRAD`: "on" (the default; tuning may choose Winograd) or "off"."""
    value = os.environ.get("NNKERNELS_WINOGRAD", "on").lower()
    if value not in ("on", "off"):
        raise ValueError(f"NNKERNELS_WINOGRAD: expected on or off, got {value!r}")
    return value == "on"


def winograd_fits(batch, height, width, channels):
    """Whether Winograd's [16, T, C] matrices of `channels` channels index in int32, as its kernels do."""
    return POINTS * tiles_of(batch, height, width) * channels < 2**31


def tf32_products(dtype, device_type="cuda"):
    """TF32 products for fp32 where torch would use them: on the GPU when `cudnn.allow_tf32` (torch's CPU
    convolution is IEEE fp32 always); 16-bit types always take the tensor-core path."""
    return dtype != torch.float32 or (device_type == "cuda" and bool(torch.backends.cudnn.allow_tf32))


class Problem:
    """The sizes of one convolution, in the names the kernels take, on `machine`."""

    def __init__(self, x_shape, w_shape, stride, padding, dilation, groups, dtype, has_bias, machine: Machine, *,
                 tf32=None, flip_taps=False, device=None, nhwc=False, w_nhwc=False):
        self.B, self.C_IN, self.H, self.W = (int(v) for v in x_shape)
        self.C_OUT, self.cin_per_group, self.KH, self.KW = (int(v) for v in w_shape)
        self.OH = output_size(self.H, self.KH, stride[0], padding[0], dilation[0])
        self.OW = output_size(self.W, self.KW, stride[1], padding[1], dilation[1])
        self.groups, self.dtype, self.has_bias, self.machine = groups, dtype, has_bias, machine
        self.device = device  # where the runners allocate (None: problems only listed, never run)
        self.tf32 = tf32_products(dtype) if tf32 is None else tf32
        self.stride, self.padding, self.dilation = tuple(stride), tuple(padding), tuple(dilation)
        self.geometry = (self.KH, self.KW, *self.stride, *self.padding, *self.dilation)
        # x, y, dy and dx channels-last (torch.channels_last strides over NHWC storage): the channels-last
        # kernels read and write them in place, every other algorithm through layout copies.
        self.nhwc = nhwc
        self.depthwise = groups == self.C_IN == self.C_OUT
        # Grouped, not depthwise: the channels-last kernels' block-diagonal tiles (several narrow groups a product).
        self.grouped = groups > 1 and not self.depthwise
        # An unpadded one-group 1x1 convolution is a matrix product per image, of x[:, :, ::s, ::s] when strided.
        self.pointwise = (self.KH, self.KW, *self.padding) == (1, 1, 0, 0) and groups == 1
        self.subsampled = self.pointwise and self.stride != (1, 1)
        self.unfolded = (groups == 1 and self.C_IN <= UNFOLD_MAX_CHANNELS and not self.pointwise
                         and not self.depthwise and self.OH * self.OW >= UNFOLD_MIN_PIXELS)
        self.unfolded_rows = self.C_IN * self.KH * self.KW
        # The same few-channel convolutions run their forward a row per program on the GPU (not in TF32, where
        # the general kernel is faster); the interpreter pays per program and keeps the general kernel's few.
        self.rows_forward = self.unfolded and not (dtype == torch.float32 and self.tf32) and machine.gpu
        # One group in whole 16-channel runs: what the TMA boxes need, and the channels-last kernels of an NCHW
        # problem (through copies, which pay off only there).
        self.whole_channel_runs = (groups == 1 and self.C_IN % CHANNELS_LAST_MULTIPLE == 0
                                   and self.C_OUT % CHANNELS_LAST_MULTIPLE == 0)
        # One group on the channels-last kernels: of a channels-last problem other channel counts too (the last K
        # slice of a tap masked, `whole_windows`), which else runs through layout copies both ways; not where a
        # slice would be mostly padding (the NCHW kernels pack a few channels' taps into K).
        self.channels_last = self.whole_channel_runs or (
            groups == 1 and nhwc and min(self.C_IN, self.C_OUT) >= MASKED_SLICE_MIN_CHANNELS)
        most_pixels = UNFOLD_DW_MAX_PIXELS if self.tf32 else UNFOLD_DW_MAX_PIXELS_FULL_FP32
        self.rows_outer_dw = (dtype == torch.float32 and self.channels_last and not self.pointwise and not nhwc
                              and self.stride == (1, 1) and self.OH * self.OW <= most_pixels)
        self.unfolded_dw = self.unfolded or self.rows_outer_dw
        self.winograd = (self.rows_outer_dw and not self.tf32 and self.geometry == (3, 3, 1, 1, 1, 1, 1, 1)
                         and min(self.C_IN, self.C_OUT) >= WINOGRAD_MIN_CHANNELS and winograd_enabled()
                         and winograd_fits(self.B, self.H, self.W, max(self.C_IN, self.C_OUT)))
        # The weight stored channels-last as well (a model moved to channels_last): the channels-last forwards, the
        # only ones a one-group channels-last problem runs, read it where it lies, as [C_OUT, KH, KW, C_IN].
        self.w_nhwc = w_nhwc and nhwc and self.channels_last
        # The channels-last copy of x pays off over KH*KW taps, and for a 1x1 layer on small planes, where the NCHW
        # products run short: there the pointwise kernels and the channels-last ones are timed against each other
        # (`conv_algorithms`); a padded 1x1 layer keeps the NCHW implicit GEMM.
        self.forward_channels_last = self.grouped or (
            self.channels_last and (nhwc or self.pointwise or self.KH * self.KW > 1))
        # dx's K slices run over C_OUT only, so any C_IN will do.
        self.dx_channels_last = self.grouped or (groups == 1 and not self.unfolded and (
            self.C_OUT % CHANNELS_LAST_MULTIPLE == 0 or (nhwc and self.C_OUT >= MASKED_SLICE_MIN_CHANNELS)))
        # The channels-last dw: one group (`channels_last`), or grouped.
        self.dw_channels_last = self.channels_last or self.grouped
        # A strided dx kernel writes each phase's pixels STRIDE_W apart: into NHWC, where a pixel's channels make
        # one run, then transposed; where C_IN is not a multiple of 16 they would not make whole runs. A
        # channels-last problem's dx is NHWC whatever its stride.
        self.dx_nhwc = self.dx_channels_last and (nhwc or (self.stride != (1, 1)
                                                          and self.C_IN % CHANNELS_LAST_MULTIPLE == 0))
        # A channels-last stride-1 1x1 layer is one product over the rows of [B*H*W, C] matrices: its channels-last
        # kernels take all its pixels as one image of one row (`pixel_grid`), so that no tile stops short at an
        # image's edge (a 7x7 plane fills 49 of a 64-pixel tile, a 14x14 one 196 of 256), where the whole tensor
        # indexes in int32 as one image must.
        self.flat_pixels = (nhwc and self.pointwise and self.stride == (1, 1)
                            and self.B * self.H * self.W * max(self.C_IN, self.C_OUT) < 2**31)
        self.flip_taps = flip_taps  # the weight's taps stored in reverse (`dx_forward`'s problems)
        # (rows, cols) of dx's pixels of one stride phase of one image (the gather-form dx kernels' unit of work)
        self.phase_plane = (-(-self.H // self.stride[0]), -(-self.W // self.stride[1]))
        self.pixels_per_phase = self.phase_plane[0] * self.phase_plane[1]
        self.key = (self.B, self.C_IN, self.C_OUT, self.H, self.W, self.geometry, groups, str(dtype), self.tf32,
                    has_bias, self.winograd) + (("nhwc",) if nhwc else ()) + (("flat",) if self.flat_pixels else ())

    @property
    def sizes(self):
        return (self.B, self.C_IN, self.C_OUT, self.H, self.W, self.OH, self.OW)

    @property
    def pixel_grid(self):
        """(B, H, W, OH, OW) as the channels-last and TMA kernels take the pixels: of a `flat_pixels` problem one
        image of one row of all B*H*W of them."""
        if self.flat_pixels:
            pixels = self.B * self.H * self.W
            return 1, 1, pixels, 1, pixels
        return self.B, self.H, self.W, self.OH, self.OW

    @property
    def grid_sizes(self):
        """`sizes` over `pixel_grid`: the size arguments of the channels-last and TMA kernels."""
        b, h, w, oh, ow = self.pixel_grid
        return (b, self.C_IN, self.C_OUT, h, w, oh, ow)

    @property
    def launch_sizes(self):
        """The size arguments of this problem's kernels (the depthwise ones take one C)."""
        if self.depthwise:
            return (self.B, self.C_IN, self.H, self.W, self.OH, self.OW)
        return self.sizes

    @property
    def x_shape(self):
        return (self.B, self.C_IN, self.H, self.W)

    @property
    def y_shape(self):
        return (self.B, self.C_OUT, self.OH, self.OW)

    @property
    def w_shape(self):
        return (self.C_OUT, self.cin_per_group, self.KH, self.KW)

    def dx_forward(self):
        """The problem whose forward convolution is this one's dx, or None where the channels-last forward cannot
        run it. With stride 1, dx = conv2d(dy, w', padding = dil*(K-1) - pad) with w'[c_in, c_out, kh, kw] =
        w[c_out, c_in, KH-1-kh, KW-1-kw] within each group (same groups): the forward's algorithms and tuning
        (split K included) serve dx."""
        if self.stride != (1, 1) or not self.dx_channels_last or (
                self.pointwise and not (self.nhwc and self.whole_channel_runs)):
            return None  # a 1x1 dx the pointwise kernel takes too: it and the channels-last dx compete in dx's tier
        pads = [d * (k - 1) - p for d, k, p in zip(self.dilation, (self.KH, self.KW), self.padding)]
        if min(pads) < 0:
            return None
        problem = Problem((self.B, self.C_OUT, self.OH, self.OW),
                          (self.C_IN, self.C_OUT // self.groups, self.KH, self.KW), (1, 1), pads, self.dilation,
                          self.groups, self.dtype, False, self.machine, tf32=self.tf32, flip_taps=True,
                          device=self.device, nhwc=self.nhwc)
        return problem if problem.forward_channels_last else None
