"""Drop-in `torch.nn` layers whose forward and backward run nnkernels' functional ops.

Each class subclasses its `torch.nn` namesake and overrides only `forward`, so the
constructor arguments, parameters, buffers, `state_dict` keys, `train()`/`eval()` and
`extra_repr` are torch's own: a checkpoint saved from one loads into the other as is.
Options the functional ops cannot honour raise `NotImplementedError` in the constructor.
Bad input raises the exception class the torch layer raises (RuntimeError for the wrong
rank, dtype or device of a convolution's input; ValueError for batch norm's rank), with a
message that says what was expected.

`convert(model)` swaps a model's supported `torch.nn` layers for these in place.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import compile_ahead
from .functional.pooling import avg_pool2d
from .functional.batchnorm import batch_norm
from .functional.conv import conv2d
from .functional.conv_transpose import conv_transpose2d
from .functional.sync_batchnorm import sync_batch_norm
from .kernel import INTERPRETED

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_LIST = "torch.float32, torch.float16 or torch.bfloat16"


def _check_input(layer: str, x, ranks: tuple):
    """The checks every layer shares: a tensor of a supported rank and dtype, on a device we run on."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: input: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ranks:
        shapes = " or ".join(f"{r}-D ({'C, H, W' if r == 3 else 'N, C, H, W'})" for r in ranks)
        raise RuntimeError(f"{layer}: input: expected a {shapes} tensor, got shape {list(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"{layer}: input: dtype {x.dtype} is not supported; expected {_DTYPE_LIST}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{layer}: input: expected a CUDA tensor (this process runs Triton compiled; CPU tensors "
            "need TRITON_INTERPRET=1 set before nnkernels is imported), got a tensor on cpu"
        )
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"{layer}: input: expected a tensor on cuda or cpu, got one on {x.device}")


def _check_like(layer: str, x, name: str, tensor, same_dtype: bool):
    """`tensor` (a parameter or buffer) must sit on x's device and, if `same_dtype`, share its dtype."""
    if tensor is None:
        return
    if tensor.device != x.device:
        raise RuntimeError(f"{layer}: input: expected a tensor on {tensor.device} like {name}, got one on {x.device}")
    if same_dtype and tensor.dtype != x.dtype:
        raise RuntimeError(f"{layer}: input: expected dtype {tensor.dtype} like {name}, got {x.dtype}")


def _autocasting(x) -> bool:
    return x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type)


def _same_padding(kernel_size, dilation) -> tuple:
    """padding='same' as a symmetric padding, when one exists (odd dilation*(k-1) needs asymmetric)."""
    padding = []
    for k, d in zip(kernel_size, dilation):
        total = d * (k - 1)
        if total % 2:
            raise NotImplementedError(
                f"padding='same' with kernel_size={tuple(kernel_size)} and dilation={tuple(dilation)} needs "
                "asymmetric padding, which nnkernels.nn.Conv2d does not support; pad explicitly"
            )
        padding.append(total // 2)
    return tuple(padding)


def _conv2d_options(conv: torch.nn.Conv2d) -> tuple:
    """The numeric padding nnkernels runs `conv` with; NotImplementedError for options it cannot run. With a
    padding_mode other than 'zeros' torch pads the input first (`F.pad`) and convolves without padding."""
    if conv.padding_mode != "zeros":
        return (0, 0)
    if conv.padding == "same":
        return _same_padding(conv.kernel_size, conv.dilation)
    if conv.padding == "valid":
        return (0, 0)
    return tuple(conv.padding)


class _Named:
    """`print(model)` names nnkernels' layers as such: nnkernels.Conv2d(...) beside torch's Conv2d(...)."""

    def _get_name(self):
        return f"nnkernels.{type(self).__name__}"


class Conv2d(_Named, torch.nn.Conv2d):
    """`torch.nn.Conv2d` running `nnkernels.functional.conv2d`. padding_mode 'reflect', 'replicate' and 'circular'
    pad as torch does, with torch's `F.pad`, before nnkernels' convolution."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _conv2d_options(self)

    def forward(self, input):
        padding = _conv2d_options(self)
        try:
            if self.padding_mode != "zeros":
                input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return conv2d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)
        except (TypeError, ValueError, RuntimeError):
            self._check(input)  # the layer's own words for what is wrong, where it can tell
            raise

    def _check(self, input):
        layer = type(self).__name__
        _check_input(layer, input, (3, 4))
        _check_like(layer, input, "weight", self.weight, same_dtype=not _autocasting(input))
        _check_like(layer, input, "bias", self.bias, same_dtype=not _autocasting(input))
        channels = input.shape[-3]
        if channels != self.in_channels:
            raise RuntimeError(
                f"{layer}: input: expected {self.in_channels} channels (dim -3) for weight of shape "
                f"{list(self.weight.shape)} and groups={self.groups}, got {channels} (shape {list(input.shape)})"
            )


class ConvTranspose2d(_Named, torch.nn.ConvTranspose2d):
    """`torch.nn.ConvTranspose2d` running `nnkernels.functional.conv_transpose2d` (output_padding below the stride;
    `output_size` in the forward as torch takes it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _transpose_options(self)

    def forward(self, input, output_size=None):
        try:
            output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size, 2,
                                                  self.dilation)
            return conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                    self.groups, self.dilation)
        except (TypeError, ValueError, RuntimeError):
            _check_input(type(self).__name__, input, (3, 4))  # the layer's own words, where it can tell
            raise


def _transpose_options(conv: torch.nn.ConvTranspose2d):
    """NotImplementedError for a transposed convolution nnkernels cannot run."""
    if any(p >= s for p, s in zip(conv.output_padding, conv.stride)):
        raise NotImplementedError(f"output_padding={tuple(conv.output_padding)} is not supported by "
                                  f"nnkernels.nn.ConvTranspose2d; it must be below the stride {tuple(conv.stride)}")


class AvgPool2d(_Named, torch.nn.AvgPool2d):
    """`torch.nn.AvgPool2d` running `nnkernels.functional.avg_pool2d`; pools in the input's dtype."""

    def forward(self, input):
        try:
            return avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                              self.count_include_pad, self.divisor_override)
        except (TypeError, ValueError, RuntimeError):
            _check_input(type(self).__name__, input, (3, 4))
            raise


def _step_statistics(layer) -> tuple:
    """(momentum, use batch statistics?, running_mean, running_var) of a batch-norm layer's step, counting the step
    in num_batches_tracked: torch.nn.BatchNorm2d's bookkeeping, line for line, so both agree on every step."""
    momentum = 0.0 if layer.momentum is None else layer.momentum
    if layer.training and layer.track_running_stats and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
        if layer.momentum is None:
            momentum = 1.0 / float(layer.num_batches_tracked)
    use_batch_stats = layer.training or (layer.running_mean is None and layer.running_var is None)
    track = not layer.training or layer.track_running_stats
    return momentum, use_batch_stats, layer.running_mean if track else None, layer.running_var if track else None


class BatchNorm2d(_Named, torch.nn.BatchNorm2d):
    """`torch.nn.BatchNorm2d` running `nnkernels.functional.batch_norm`.

    Same semantics as torch's: batch statistics in training (running statistics updated in
    place, cumulative average when momentum is None), running statistics in eval; fp16/bf16
    input with fp32 parameters and statistics gives output in the input's dtype.
    """

    def forward(self, input):
        if not isinstance(input, torch.Tensor) or input.dim() != 4:
            self._check(input)
        momentum, use_batch_stats, running_mean, running_var = _step_statistics(self)
        try:
            return batch_norm(input, running_mean, running_var, self.weight, self.bias, training=use_batch_stats,
                              momentum=momentum, eps=self.eps)
        except (TypeError, ValueError, RuntimeError):
            self._check(input)  # the layer's own words for what is wrong, where it can tell
            raise

    def _check(self, input):
        layer = type(self).__name__
        if isinstance(input, torch.Tensor) and input.dim() != 4:  # torch.nn.BatchNorm2d's error and words
            raise ValueError(f"{layer}: expected 4D input (got {input.dim()}D input)")
        _check_input(layer, input, (4,))
        for name in ("weight", "bias", "running_mean", "running_var"):
            tensor = getattr(self, name)
            _check_like(layer, input, name, tensor, same_dtype=False)
            if name.startswith("running") and tensor is not None and tensor.dtype != torch.float32:
                raise NotImplementedError(f"{layer}: {name} has dtype {tensor.dtype}; nnkernels keeps batch-norm "
                                          "statistics in torch.float32 (keep the layer in float32, as autocast does)")
            if tensor is not None and tensor.numel() != input.shape[1]:
                raise RuntimeError(
                    f"{layer}: input: expected {tensor.numel()} channels (dim 1) like {name}, "
                    f"got {input.shape[1]} (shape {list(input.shape)})"
                )


class SyncBatchNorm(_Named, torch.nn.SyncBatchNorm):
    """`torch.nn.SyncBatchNorm` running `nnkernels.functional.sync_batchnorm.sync_batch_norm` in training with a
    process group of two or more ranks, `nnkernels.functional.batch_norm` otherwise (evaluation, one rank, or no
    initialised process group), by torch's own rule. Unlike torch's, it also runs on CPU tensors where Triton is
    interpreted (gloo).

    Gradients of weight and bias are this rank's own, as torch's are (DistributedDataParallel averages them).
    Under torch.compile, with no process group or one rank, it is batch norm and compiles into the graph
    (fullgraph=True included); with two or more ranks the synchronised forward runs outside the graph, a graph
    break, so fullgraph=True fails there, as it does for torch.nn.SyncBatchNorm, which dynamo does not trace
    (its collectives take a ProcessGroup object).
    """

    def forward(self, input):
        if not isinstance(input, torch.Tensor) or input.dim() < 2:
            raise ValueError(f"{type(self).__name__}: expected at least 2D input (got "
                             f"{input.dim() if isinstance(input, torch.Tensor) else type(input).__name__}D input)")
        if input.shape[1] == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        momentum, use_batch_stats, running_mean, running_var = _step_statistics(self)
        # torch.nn.SyncBatchNorm's rule: synchronise in training only, with an initialised group of 2+ ranks.
        world_size = 1
        if self.training and torch.distributed.is_available() and torch.distributed.is_initialized():
            group = self.process_group or torch.distributed.group.WORLD
            world_size = torch.distributed.get_world_size(group)
        if world_size > 1:
            return sync_batch_norm(input, running_mean, running_var, self.weight, self.bias, momentum, self.eps,
                                   group, world_size)
        return batch_norm(input, running_mean, running_var, self.weight, self.bias, training=use_batch_stats,
                          momentum=momentum, eps=self.eps)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """torch.nn.SyncBatchNorm.convert_sync_batchnorm's conversion, into nnkernels' layer: every batch norm of
        `module` (torch's `_BatchNorm` kinds, nnkernels' BatchNorm2d among them) becomes an nnkernels
        SyncBatchNorm holding the same Parameters and buffers, synchronised over `process_group` (None: the
        world). A layer nnkernels cannot run (statistics not in float32, say) becomes torch's SyncBatchNorm, so
        every batch norm synchronises either way. Returns `module`, or the new layer if `module` is one."""
        converted = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            kind = cls if _batch_norm_supported(module) else torch.nn.SyncBatchNorm
            converted = kind(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, process_group, device="meta")
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            else:
                converted.weight = converted.bias = None
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def _batch_norm_supported(module) -> bool:
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if name.startswith("running") and tensor.dtype != torch.float32:
            return False
        if name != "num_batches_tracked" and tensor.dtype not in SUPPORTED_DTYPES:
            return False
    return True


@dataclass
class ConversionSummary:
    """What `convert` did: layers swapped per kind, and each layer left alone with the reason."""

    swapped: "OrderedDict[str, int]" = field(
        default_factory=lambda: OrderedDict((k, 0) for k in ("Conv2d", "ConvTranspose2d", "AvgPool2d", "BatchNorm2d",
                                                              "SyncBatchNorm"))
    )
    left: list = field(default_factory=list)  # (qualified name, kind, reason)

    def __str__(self):
        # ConvTranspose2d and SyncBatchNorm only where a model has one: most do not
        counts = ", ".join(f"{n} {kind}" for kind, n in self.swapped.items()
                           if n or kind not in ("ConvTranspose2d", "SyncBatchNorm"))
        lines = [f"nnkernels.convert: swapped {counts}; left {len(self.left)}"]
        lines += [f"  left {name} ({kind}): {reason}" for name, kind, reason in self.left]
        return "\n".join(lines)


_REPLACEMENTS = {torch.nn.Conv2d: Conv2d, torch.nn.ConvTranspose2d: ConvTranspose2d,
                 torch.nn.AvgPool2d: AvgPool2d, torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.SyncBatchNorm: SyncBatchNorm}


def _unsupported(module) -> str | None:
    """Why nnkernels cannot run `module` (a torch layer of a convertible kind), or None if it can."""
    if type(module) not in _REPLACEMENTS:
        cls = type(module)
        return f"{cls.__module__}.{cls.__qualname__} subclasses a torch layer and may change its forward"
    options = {torch.nn.Conv2d: _conv2d_options, torch.nn.ConvTranspose2d: _transpose_options}.get(type(module))
    if options is not None:
        try:
            options(module)
        except NotImplementedError as err:
            return str(err)
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if name.startswith("running") and tensor.dtype != torch.float32:
            return f"{name} has dtype {tensor.dtype}; nnkernels keeps batch-norm statistics in torch.float32"
        if name != "num_batches_tracked" and tensor.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {tensor.dtype}; nnkernels runs {_DTYPE_LIST}"
    return None


def _swap(module):
    """The nnkernels layer sharing every Parameter, buffer, hook and attribute of torch layer `module`."""
    swapped = _REPLACEMENTS[type(module)].__new__(_REPLACEMENTS[type(module)])
    swapped.__dict__.update(module.__dict__)
    # Fresh containers, so that later assignments to one layer leave the other alone.
    swapped._parameters = dict(module._parameters)
    swapped._buffers = dict(module._buffers)
    swapped._modules = dict(module._modules)
    swapped._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return swapped


def convert(model: torch.nn.Module, verbose: bool = False) -> torch.nn.Module:
    """Replace, in place, every `torch.nn.Conv2d`, `ConvTranspose2d`, `AvgPool2d`, `BatchNorm2d` and `SyncBatchNorm`
    of `model` that nnkernels supports with the nnkernels layer holding the same Parameters and buffers.

    Returns `model` (or, when `model` is itself such a layer, its replacement) with the
    `ConversionSummary` attached as `.nnkernels_summary`; `verbose` also prints it. A model holding nnkernels
    convolutions also gets a forward pre-hook that compiles their kernels in background processes at its first
    forward on a GPU (`nnkernels.compile_ahead`; `NNKERNELS_COMPILE_AHEAD=off` turns it off).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    summary = ConversionSummary()
    kinds = tuple(_REPLACEMENTS)
    ours = tuple(_REPLACEMENTS.values())
    replaced = {}  # id(layer) -> its replacement, so a layer shared by two parents stays shared

    def visit(module, name):
        if isinstance(module, ours):
            return module
        if id(module) in replaced:
            return replaced[id(module)]
        if isinstance(module, kinds):
            kind = next(k.__name__ for k in kinds if isinstance(module, k))
            reason = _unsupported(module)
            if reason is None:
                summary.swapped[kind] += 1
                replaced[id(module)] = _swap(module)
                return replaced[id(module)]
            summary.left.append((name or "<model>", kind, reason))
            return module
        for child_name, child in list(module._modules.items()):
            if child is not None:
                replacement = visit(child, f"{name}.{child_name}" if name else child_name)
                if replacement is not child:
                    module._modules[child_name] = replacement
        return module

    model = visit(model, "")
    if not isinstance(model, ours) and any(isinstance(m, (Conv2d, ConvTranspose2d)) for m in model.modules()):
        compile_ahead.attach(model)
    model.__dict__["nnkernels_summary"] = summary
    if verbose:
        print(summary)
    return model
