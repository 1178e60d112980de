"""The per-shape plan of `conv2d` (`Problem`): a convolution's sizes in the kernels' names, which path each of
its passes takes (depthwise, 1x1 products, unfolded, channels-last implicit GEMM, TMA boxes, Winograd, NCHW
implicit GEMM), the tuning candidates of each and the kernel objects a config makes. The thresholds below
are where those paths won on the H200; `functional.conv2d` runs the passes.
"""
from __future__ import annotations

import functools

import torch

from .. import tuning
from ..kernel import INTERPRETED
from ..ops.conv2d.depthwise import Conv2dDepthwiseDw, Conv2dDepthwiseDx, Conv2dDepthwiseForward, gather_columns_fit
from ..ops.conv2d.channels_last import Conv2dGemmClDw, Conv2dGemmClForward
from ..ops.conv2d.channels_last_dx import Conv2dGemmClDx
from ..ops.conv2d.partials import Conv2dDwReduce
from ..ops.conv2d.gemm_dw import Conv2dGemmDw
from ..ops.conv2d.gemm_dx import Conv2dGemmDx
from ..ops.conv2d.gemm_forward import Conv2dGemmForward
from ..ops.conv2d.pointwise import Conv2dPointwise, Conv2dPointwiseDw, Conv2dPointwiseFp32Out
from ..ops.conv2d.rows_forward import Conv2dRowsForward
from ..ops.conv2d.tma_dw import Conv2dTmaDw
from ..ops.conv2d.tma_forward import Conv2dTmaForward
from . import winograd
from .layout import channels_last, subsample
from .unfold import fold_kernel, unfold_kernel

CHANNELS_LAST_MULTIPLE = 16
# The unfolded path's columns are made and used in slices of the batch of at most this many bytes (at
# least one image), which bounds its scratch memory. Slices small enough to be read back from L2 were
# slower on the H200 (the stem's backward in bf16, B32: 805 µs in 8 MB slices, 535 in 32 MB, 466 whole).
UNFOLD_SLICE_BYTES = 2**30
# The unfolded backward is for few input channels and large planes (the RGB stem's 112x112 outputs). On the
# H200 it beat the implicit GEMM with 3 and 4 input channels (3->64 7x7 s2 @224, 3->64 @32, 3->32 s2 @224,
# 4->32 @112, bf16 and TF32); with 8 (8->32 @112), in TF32 it lost. Smaller planes keep the implicit GEMM.
UNFOLD_MAX_CHANNELS = 4
UNFOLD_MIN_PIXELS = 1024
# fp32 weight gradients of small planes are one 1x1 product over B*OH*OW pixels of rows-outer unfolded
# columns. On the H200 (ResNet-50's 3x3 layers, B32) the backward against the TMA boxes' dw: 7x7 planes TF32
# 194 -> 157 µs, full fp32 410 -> 337; 14x14 TF32 161 -> 150, full fp32 336 -> 323; on 28x28 planes the
# unfold (43 µs) and the product (59) cost more than the TMA dw (108, TF32). With TF32 off the TMA dw's
# three products cost more: the backward (dx + dw, same run) at 28x28 404 -> 329 µs, at 56x56 399 -> 375.
UNFOLD_DW_MAX_PIXELS = 256
UNFOLD_DW_MAX_PIXELS_FULL_FP32 = 4096
# Winograd F(2x2, 3x3) (`functional.winograd`) is offered to tuning for full-fp32 3x3 stride-1 pad-1 layers with
# at least this many channels in and out, on planes of at most UNFOLD_DW_MAX_PIXELS_FULL_FP32 pixels (where
# the direct dw it competes with is the unfolded one), and tried first on planes of at most
# WINOGRAD_FIRST_PIXELS. On the H200 (B32, µs, forward / dw), Winograd's parts summed, against cuDNN in the same
# run (nineteenth session): 128@28 119.4 / 110.6 against 129.0 / 116.4; 256@14 98.6 / 95.5 against 254.8 / 95.4;
# 64@56 171.2 / 169.6 against 256.6 / 298.3. Our direct kernels, in earlier sessions' runs: 128@28 139.5 / 175.6,
# 256@14 forward 138.0, 64@56 forward 135.6. The suites' tuning then chose Winograd for the forward on planes up
# to 28x28 and for dw on all of them (BENCHMARKS.md). With fewer channels the products are too thin for the
# transforms' traffic to pay.
WINOGRAD_MIN_CHANNELS = 64
WINOGRAD_FIRST_PIXELS = 28 * 28
# The unfold geometry that lays dy out rows-outer: a 1x1 window, stride 1, no padding.
ROWS_OUTER_COPY = (1, 1, 1, 1, 0, 0, 1, 1)


def output_size(size, kernel, stride, pad, dilation):
    """An output side of a convolution, as torch computes it."""
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


@functools.lru_cache(maxsize=None)
def _kernel(cls, constants, dtype, num_warps, num_stages):
    """One kernel object per class, constants and launch options."""
    return cls(*constants, dtype=dtype, num_warps=num_warps, num_stages=num_stages)


def _is_depthwise(c_in, c_out, groups):
    return groups == c_in == c_out


def has_tma(device):
    """Whether kernels copying TMA boxes run on `device`: GPUs of compute capability 9.0 and up, and the
    interpreter (CPU tensors)."""
    if device.type == "cpu":
        return True
    gpu = tuning.device_properties(device.index if device.index is not None else torch.cuda.current_device())
    return (gpu.major, gpu.minor) >= (9, 0)


def _tf32(dtype):
    """TF32 products for fp32 when cuDNN would use them; 16-bit types always take the tensor-core path."""
    return dtype != torch.float32 or bool(torch.backends.cudnn.allow_tf32)


class Problem:
    """The sizes of one convolution, in the names the kernels take."""

    def __init__(self, x_shape, w_shape, stride, padding, dilation, groups, dtype, has_bias, flip_taps=False):
        self.B, self.C_IN, self.H, self.W = (int(v) for v in x_shape)
        self.C_OUT, self.cin_per_group, self.KH, self.KW = (int(v) for v in w_shape)
        self.OH = output_size(self.H, self.KH, stride[0], padding[0], dilation[0])
        self.OW = output_size(self.W, self.KW, stride[1], padding[1], dilation[1])
        self.groups, self.dtype, self.has_bias = groups, dtype, has_bias
        self.tf32 = _tf32(dtype)
        self.geometry = (self.KH, self.KW, *stride, *padding, *dilation)
        self.geometry_args = (tuple(stride), tuple(padding), tuple(dilation), groups)
        self.dilation = dilation
        self.depthwise = _is_depthwise(self.C_IN, self.C_OUT, groups)
        # An unpadded, one-group 1x1 convolution is a matrix product per image, of x[:, :, ::s, ::s]
        # when strided (`subsampled`).
        self.pointwise = (self.KH, self.KW, *padding) == (1, 1, 0, 0) and groups == 1
        self.stride = tuple(stride)
        self.subsampled = self.pointwise and self.stride != (1, 1)
        # With few input channels the implicit GEMM's C_IN tile is mostly padding: the backward runs as
        # 1x1 products over the C_IN*KH*KW rows of the unfolded input (see ops/conv2d/unfold.py). The forward
        # does not unfold: the implicit GEMM was faster on the H200 (stem, B32: bf16 163 µs against 335,
        # TF32 150 against 406, full fp32 414 against 524).
        self.unfolded = (groups == 1 and self.C_IN <= UNFOLD_MAX_CHANNELS and not self.pointwise
                         and not self.depthwise and self.OH * self.OW >= UNFOLD_MIN_PIXELS)
        self.unfolded_rows = self.C_IN * self.KH * self.KW
        # On the GPU the same few-channel convolutions run their forward one output row per program
        # (`Conv2dRowsForward`): on the H200 (stem, B32, best tiles, same run) bf16 163.6 -> 124.5 µs, full
        # fp32 414.0 -> 346.4; with TF32 the general kernel stays, 148.4 against 160.7. The interpreter pays per
        # program, and those are B*OH: it keeps the general kernel's few large ones (bf16 8x3x64x64 7x7 s2
        # here: 23 s a forward against 0.15 s).
        self.rows_forward = self.unfolded and not (dtype == torch.float32 and self.tf32) and not INTERPRETED
        self.channels_last = (groups == 1 and self.C_IN % CHANNELS_LAST_MULTIPLE == 0
                              and self.C_OUT % CHANNELS_LAST_MULTIPLE == 0)
        # The fp32 weight gradient of small planes (larger ones with TF32 off), where the TMA dw would run
        # (channels-last, stride 1), is one 1x1 product of the columns unfolded rows-outer ([C_IN*KH*KW, B, OH,
        # OW]) and dy laid out the same way ([C_OUT, B, OH, OW]): a reduction over all B*OH*OW pixels in runs the
        # tensor cores read directly.
        most_pixels = UNFOLD_DW_MAX_PIXELS if self.tf32 else UNFOLD_DW_MAX_PIXELS_FULL_FP32
        self.rows_outer_dw = (dtype == torch.float32 and self.channels_last and not self.pointwise
                              and self.stride == (1, 1) and self.OH * self.OW <= most_pixels)
        self.unfolded_dw = self.unfolded or self.rows_outer_dw
        self.winograd = (self.rows_outer_dw and not self.tf32 and self.geometry == (3, 3, 1, 1, 1, 1, 1, 1)
                         and min(self.C_IN, self.C_OUT) >= WINOGRAD_MIN_CHANNELS and winograd.enabled()
                         and winograd.fits(self.B, self.H, self.W, max(self.C_IN, self.C_OUT)))
        # The forward's channels-last copy of x pays off over KH*KW taps; for a 1x1 convolution
        # the NCHW kernel measured faster on the H200 (bf16 0.23 vs 0.27 ms, TF32 0.18 vs 0.31 ms).
        self.forward_channels_last = self.channels_last and self.KH * self.KW > 1 and not self.pointwise
        # dx's K slices run over C_OUT only, so any C_IN will do.
        self.dx_channels_last = (groups == 1 and self.C_OUT % CHANNELS_LAST_MULTIPLE == 0 and not self.pointwise
                                 and not self.depthwise and not self.unfolded)
        # A strided dx kernel writes each phase's pixels, STRIDE_W apart: into NHWC, where a pixel's
        # channels are one run, and transposed after (see `Conv2dGemmClDx`); where C_IN is not a
        # multiple of 16 they would not make whole runs.
        self.dx_nhwc = (self.dx_channels_last and self.stride != (1, 1)
                        and self.C_IN % CHANNELS_LAST_MULTIPLE == 0)
        self.flip_taps = flip_taps  # the weight's taps stored in reverse (`dx_forward`'s problems)
        # dx pixels of one stride phase of one image (the gather-form dx kernels' unit of work)
        self.pixels_per_phase = -(-self.H // stride[0]) * -(-self.W // stride[1])
        self.key = (self.B, self.C_IN, self.C_OUT, self.H, self.W, self.geometry, groups, str(dtype), self.tf32,
                    has_bias, self.winograd)

    @property
    def sizes(self):
        return (self.B, self.C_IN, self.C_OUT, self.H, self.W, self.OH, self.OW)

    @property
    def launch_sizes(self):
        """The size arguments of this problem's kernels (the depthwise ones take one C)."""
        if self.depthwise:
            return (self.B, self.C_IN, self.H, self.W, self.OH, self.OW)
        return self.sizes

    def cl_forward_candidates(self, device):
        """The channels-last forward's configs, `Conv2dTmaForward`'s boxes among them where it runs (stride 1,
        a GPU with a TMA unit or the interpreter)."""
        boxes = self.stride == (1, 1) and has_tma(device)
        direct = tuning.channels_last_candidates(self.B, self.OH * self.OW, self.C_OUT, self.C_IN, self.dtype,
                                                 taps=self.KH * self.KW,
                                                 tma_plane=(self.OH, self.OW) if boxes else None)
        if not self.winograd:
            return direct
        return self._with_winograd(direct, tuning.winograd_candidates(self.C_OUT, self.C_IN))

    def _with_winograd(self, direct, winograd_configs):
        """A candidate list with Winograd's configs: its first guess first on planes of at most
        WINOGRAD_FIRST_PIXELS (second on larger ones, so that quick tuning times it), the others last. The
        interpreter keeps the direct kernels' first guess first."""
        if INTERPRETED:
            return direct + winograd_configs
        place = 0 if self.OH * self.OW <= WINOGRAD_FIRST_PIXELS else 1
        return direct[:place] + winograd_configs[:1] + direct[place:] + winograd_configs[1:]

    def cl_dx_candidates(self):
        return tuning.channels_last_candidates(self.B, self.pixels_per_phase, self.C_IN, self.C_OUT, self.dtype)

    def cl_dw_candidates(self):
        return tuning.channels_last_dw_candidates(self.C_OUT, self.C_IN, self.KH * self.KW,
                                                  self.B * self.OH * self.OW, self.dtype)

    def cl_forward_kernel(self, config):
        if config.tma:
            box = tuning.tma_forward_box(config.block_m, self.OH, self.OW)
            constants = self.geometry + (self.has_bias, self.tf32, self.flip_taps, *box, config.block_n, config.block_k,
                                         config.split)
            return _kernel(Conv2dTmaForward, constants, self.dtype, config.num_warps, config.num_stages)
        block_q = tuning.image_tile(config.block_m, self.OH * self.OW, config.image_pixels)
        constants = self.geometry + (self.has_bias, self.tf32, self.flip_taps, config.block_m, config.block_n,
                                     config.block_k, block_q, config.split)
        return _kernel(Conv2dGemmClForward, constants, self.dtype, config.num_warps, config.num_stages)

    def split_sum_kernel(self, numel):
        """The ordered sum of a split-K forward's fp32 partials into y (the dw reduce, TAPS = 1)."""
        return _kernel(Conv2dDwReduce, (False, 1, *tuning.reduce_tile(numel)), self.dtype, 4, 1)

    @staticmethod
    def cl_dx_weight(weight):
        """The dx kernel's weight operand, [KH, KW, C_IN, C_OUT]: contiguous along the reduced c_out,
        as TF32 tensor cores want it (see `Conv2dGemmClDx`). Tiny next to the activations."""
        return weight.permute(2, 3, 1, 0).contiguous()

    def dx_forward(self):
        """The problem whose forward convolution is this one's dx, or None where the channels-last
        forward cannot run it. With stride 1, dx = conv2d(dy, w', padding = dil*(K-1) - pad) with
        w'[c_in, c_out, kh, kw] = w[c_out, c_in, KH-1-kh, KW-1-kw]: the forward kernel and its tuning
        (split K included) serve dx. Measured on the H200 against `Conv2dGemmClDx` on the bench's five
        stride-1 3x3 layers in bf16, TF32 and full fp32: 4% to 23% less time on each of the 15."""
        if self.stride != (1, 1) or not self.dx_channels_last:
            return None
        pads = [d * (k - 1) - p for d, k, p in zip(self.dilation, (self.KH, self.KW), self.geometry[4:6])]
        if min(pads) < 0:
            return None
        problem = Problem((self.B, self.C_OUT, self.OH, self.OW), (self.C_IN, self.C_OUT, self.KH, self.KW), (1, 1),
                           pads, self.dilation, 1, self.dtype, False, flip_taps=True)
        return problem if problem.forward_channels_last else None

    @staticmethod
    def dx_forward_weight(weight):
        """`dx_forward`'s weight in the channels-last forward's layout, [C_IN, KH, KW, C_OUT], taps
        not flipped (the kernel reads them in reverse: FLIP_TAPS): weight as [1, C_OUT, C_IN*KH*KW, 1]
        made channels-last by the tile transpose. For ResNet-50's 512-channel 3x3 weight in bf16 the
        H200 profile had PyTorch's permuted copy at 16.5 us (its c_out runs are 4608 elements apart),
        the tile transpose at about 3 us."""
        c_out, c_in, kh, kw = weight.shape
        return channels_last(weight.reshape(1, c_out, c_in * kh * kw, 1)).reshape(c_in, kh, kw, c_out)

    def cl_dx_kernel(self, config):
        block_q = tuning.image_tile(config.block_m, self.pixels_per_phase)
        constants = self.geometry + (self.tf32, self.dx_nhwc, config.block_m, config.block_n,
                                     config.block_k, block_q)
        return _kernel(Conv2dGemmClDx, constants, self.dtype, config.num_warps, config.num_stages)

    def tma_dw(self, device):
        """dw from TMA boxes (`Conv2dTmaDw`): channels-last, stride 1, where `_has_tma`."""
        return self.channels_last and self.stride == (1, 1) and has_tma(device)

    def tma_dw_candidates(self):
        return tuning.tma_dw_candidates(self.C_OUT, self.C_IN, self.KH, self.KW, self.B, self.OH, self.OW, self.dtype)

    def tma_dw_kernel(self, config, with_bias):
        box = tuning.tma_box(self.OH, self.OW, config.block_k)
        constants = self.geometry + (with_bias, self.tf32, config.taps, config.block_m, config.block_n) + box
        return _kernel(Conv2dTmaDw, constants, self.dtype, config.num_warps, config.num_stages)

    def cl_dw_kernel(self, config, with_bias):
        tap_span = max(1, config.block_n // self.C_IN)  # a column tile wider than C_IN spans taps
        constants = self.geometry + (with_bias, self.tf32, config.block_m, config.block_n, config.block_k, tap_span)
        return _kernel(Conv2dGemmClDw, constants, self.dtype, config.num_warps, config.num_stages)

    def forward_candidates(self):
        if self.rows_forward:
            return tuning.rows_forward_candidates(self.OW, self.C_OUT, self.KW, self.dtype)
        return tuning.gemm_candidates(self.B * self.OH * self.OW, self.C_OUT // self.groups,
                                      self.cin_per_group * self.KH * self.KW, self.dtype)

    def dx_candidates(self):
        s_h, s_w = self.geometry[2:4]
        pixels = self.B * -(-self.H // s_h) * -(-self.W // s_w)
        return tuning.gemm_candidates(pixels, self.cin_per_group, self.C_OUT // self.groups * self.KH * self.KW,
                                      self.dtype)

    def dw_candidates(self):
        return tuning.dw_candidates(self.C_OUT // self.groups, self.cin_per_group * self.KH * self.KW,
                                    self.B * self.OH * self.OW, self.groups, self.dtype)

    def _depthwise_kernel(self, kernel_class, flags, tile, gather_columns=()):
        constants = self.geometry + flags + (tile.planes, tile.rows, tile.block_w) + gather_columns
        return _kernel(kernel_class, constants, self.dtype, tile.num_warps, 1)

    def _gather_columns(self, tile):
        """The forward's and dw's GATHER_COLUMNS: x rows loaded once, their taps shifted across lanes,
        where they fit (`gather_columns_fit`). Not dx: on the H200 it made dx slower (B32 C256 28x28:
        23 -> 27 µs in bf16, 27 -> 33 µs in fp32), while the forward and dw gained."""
        return (gather_columns_fit(self.stride[1], self.KW, self.dilation[1], self.OW, tile.block_w),)

    def depthwise_forward_kernel(self):
        tile = tuning.depthwise_tile(self.B * self.C_IN, self.OH, self.OW)
        return self._depthwise_kernel(Conv2dDepthwiseForward, (self.has_bias,), tile, self._gather_columns(tile))

    def depthwise_dx_kernel(self):
        tile = tuning.depthwise_tile(self.B * self.C_IN, self.H, self.W, row_step=self.stride[0])
        return self._depthwise_kernel(Conv2dDepthwiseDx, (), tile)

    def depthwise_dw_tile(self):
        return tuning.depthwise_tile(self.B * self.C_IN, self.OH, self.OW, channels=self.C_IN)

    def depthwise_dw_split(self):
        return tuning.depthwise_dw_split(self.B, self.depthwise_dw_tile(), self.OH, self.OW)

    def depthwise_dw_kernel(self, with_bias):
        taps = tuning.pow2_at_least(self.KH * self.KW + 1)  # a column for the bias
        tile = self.depthwise_dw_tile()
        return self._depthwise_kernel(Conv2dDepthwiseDw, (with_bias, taps), tile, self._gather_columns(tile))

    def forward_kernel(self, config):
        if self.rows_forward:
            constants = self.geometry + (self.has_bias, self.tf32, config.block_m, config.block_n, config.block_k,
                                         tuning.pow2_at_least(self.KW))
            return _kernel(Conv2dRowsForward, constants, self.dtype, config.num_warps, config.num_stages)
        constants = self.geometry + (self.groups, self.has_bias, self.tf32, config.block_m, config.block_n,
                                     config.block_k)
        return _kernel(Conv2dGemmForward, constants, self.dtype, config.num_warps, config.num_stages)

    def dx_kernel(self, config):
        constants = self.geometry + (self.groups, self.tf32, config.block_m, config.block_n, config.block_k)
        return _kernel(Conv2dGemmDx, constants, self.dtype, config.num_warps, config.num_stages)

    def dw_kernel(self, config, with_bias):
        constants = self.geometry + (self.groups, with_bias, self.tf32, config.block_m, config.block_n,
                                     config.block_k)
        return _kernel(Conv2dGemmDw, constants, self.dtype, config.num_warps, config.num_stages)

    def pointwise_input(self, x):
        """What the 1x1 kernels multiply: x, or x[:, :, ::s_h, ::s_w] when strided."""
        return subsample(x, self.stride) if self.subsampled else x

    def pointwise_dx(self, device):
        """A buffer for the 1x1 dx kernel: [B, C_IN, OH, OW], dx's shape when unstrided, dx's pixels on
        the stride lattice when strided (`subsample_backward` then spreads them)."""
        return torch.empty(self.B, self.C_IN, self.OH, self.OW, dtype=self.dtype, device=device)

    def pointwise_candidates(self, for_dx=False):
        c_out, c_in = (self.C_IN, self.C_OUT) if for_dx else (self.C_OUT, self.C_IN)
        return tuning.pointwise_candidates(c_out, c_in, self.OH * self.OW, self.dtype, self.tf32)

    def pointwise_kernel(self, config, for_dx=False):
        constants = (self.has_bias and not for_dx, self.tf32, config.block_m, config.block_n, config.block_k,
                     config.m_tiles)
        return _kernel(Conv2dPointwise, constants, self.dtype, config.num_warps, config.num_stages)

    def pointwise_dw_candidates(self):
        return tuning.pointwise_dw_candidates(self.C_OUT, self.C_IN, self.OH * self.OW, self.B, self.dtype)

    def unfold_slices(self, element_size):
        """[first, end) slices of the batch whose columns (n*C_IN*KH*KW*OH*OW elements, in either layout) take
        at most UNFOLD_SLICE_BYTES, at least one image each."""
        step = max(1, UNFOLD_SLICE_BYTES // (self.unfolded_rows * self.OH * self.OW * element_size))
        return [(first, min(first + step, self.B)) for first in range(0, self.B, step)]

    def unfolded_dx_candidates(self):
        return tuning.pointwise_candidates(self.unfolded_rows, self.C_OUT, self.OH * self.OW, self.dtype,
                                           self.tf32)

    def unfolded_dx_weight(self, weight):
        """dx's columns weight: w as [C_OUT, C_IN*KH*KW], transposed (tiny)."""
        return weight.reshape(self.C_OUT, self.unfolded_rows).t().contiguous()

    def unfolded_dx_kernel(self, config):
        constants = (self.tf32, config.block_m, config.block_n, config.block_k, config.m_tiles)
        return _kernel(Conv2dPointwiseFp32Out, constants, self.dtype, config.num_warps, config.num_stages)

    def unfolded_dw_candidates(self):
        smallest_slice = min(end - first for first, end in self.unfold_slices(self.dtype.itemsize))
        if self.rows_outer_dw:
            direct = tuning.rows_outer_dw_candidates(self.C_OUT, self.unfolded_rows, smallest_slice * self.OH * self.OW,
                                                     self.dtype)
            if not self.winograd:
                return direct
            tiles = winograd.tiles_of(self.B, self.H, self.W)
            return self._with_winograd(direct, tuning.winograd_dw_candidates(self.C_OUT, self.C_IN, tiles))
        return tuning.pointwise_dw_candidates(self.C_OUT, self.unfolded_rows, self.OH * self.OW, smallest_slice,
                                              self.dtype)

    def unfold_kernel(self):
        return unfold_kernel(self.geometry, (self.OH, self.OW), self.dtype, self.rows_outer_dw)

    def grad_rows_kernel(self):
        """The unfold that lays dy out rows-outer for `rows_outer_dw`."""
        return unfold_kernel(ROWS_OUTER_COPY, (self.OH, self.OW), self.dtype, True)

    def fold_kernel(self):
        return fold_kernel(self.geometry, self.H, self.W, self.dtype)

    def pointwise_dw_kernel(self, config, with_bias):
        constants = (with_bias, self.tf32, config.block_m, config.block_n, config.block_k)
        return _kernel(Conv2dPointwiseDw, constants, self.dtype, config.num_warps, config.num_stages)

    def dw_taps(self, tma_dw):
        """The reduce's TAPS: KH*KW after the TMA dw (tap-major partials), else 1."""
        return self.KH * self.KW if tma_dw else 1

    def reduce_kernel(self, with_bias, taps=1):
        """The dw reduce; `taps` = KH*KW for the TMA dw's tap-major partials, 1 for dw-ordered ones."""
        positions = self.C_OUT * self.cin_per_group * self.KH * self.KW // taps
        return _kernel(Conv2dDwReduce, (with_bias, taps, *tuning.reduce_tile(positions, taps)), self.dtype, 4, 1)
