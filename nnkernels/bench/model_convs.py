"""Benchmark: every convolution of well-known torchvision models, nnkernels against cuDNN, NCHW and channels_last.

Each model's `nn.Conv2d` layers are found with forward hooks on one forward pass on the meta device (no GPU
memory, no weights) at the model's own input size, batch 32 unless `batch` says otherwise, and deduplicated
across the models with how often each model holds each. Every distinct layer is then timed as the conv2d
suite times its rows (each side captured in a CUDA graph, `do_bench` median, default tuning, `cudnn.benchmark`
on): the forward, `nnkernels::conv2d` against `F.conv2d`, and the backward, dx + dw (+ dbias where the layer
has a bias), `nnkernels::conv2d_backward` against `aten.convolution_backward`; in NCHW and in channels_last
(input, weight and dy channels-last on both sides); per precision (bf16, tf32 = fp32 with TF32 products, fp32
= TF32 off). Besides a row per layer, a row per model, precision, layout and pass sums its layers' times,
each weighted by its count: the convolutions' share of that model's training step. `quick` takes bf16 in
NCHW alone.

    nnkernels bench model-convs [MODEL...] [--batch N] [--precisions bf16,tf32,fp32]
"""
from __future__ import annotations

import collections

import torch

from ..layer_calls import ConvShape, conv_shapes
from ..parallel_compile import precompile_layers
from . import harness

# model -> its input size (square images)
MODELS = {"resnet50": 224, "resnext50_32x4d": 224, "regnet_y_1_6gf": 224, "inception_v3": 299, "vgg16_bn": 224,
          "mobilenet_v3_large": 224, "efficientnet_b0": 224, "densenet121": 224, "deeplabv3_resnet50": 512,
          "convnext_tiny": 224}
BATCH = 32
# name -> (element type, cudnn.allow_tf32)
PRECISIONS = {"bf16": (torch.bfloat16, True), "tf32": (torch.float32, True), "fp32": (torch.float32, False)}
DEFAULT_PRECISIONS = ("bf16", "tf32")
LAYOUTS = ("nchw", "channels_last")
WORKERS = 12


def model_shapes(name: str, batch: int = BATCH) -> collections.Counter:
    """`conv_shapes` of torchvision's `name` (random weights) at its input size; deeplabv3_resnet50 is its dilated
    backbone."""
    import torchvision

    if name not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}")
    if name == "deeplabv3_resnet50":
        model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None).backbone
    elif name == "inception_v3":
        model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
    else:
        model = torchvision.models.get_model(name, weights=None)
    return conv_shapes(model, (batch, 3, MODELS[name], MODELS[name]))


def _tensors(shape: ConvShape, dtype, layout, seed=0):
    """(x, weight, dy), fresh random, in `layout`."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format

    def make(size):
        return torch.randn(size, device="cuda", generator=generator).to(dtype).contiguous(memory_format=memory_format)

    return make(shape.x_shape), make(shape.w_shape), make(shape.y_shape)


def time_layer(shape: ConvShape, precision: str, layout: str) -> dict:
    """{(side, pass): ms} for side in ("ours", "torch"), pass in ("forward", "backward")."""
    from ..functional import conv  # noqa: F401  (registers torch.ops.nnkernels.conv2d*)

    dtype, tf32 = PRECISIONS[precision]
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        x, weight, dy = _tensors(shape, dtype, layout)
        bias = torch.randn(shape.w_shape[0], device="cuda").to(dtype) if shape.bias else None
        args = (list(shape.stride), list(shape.padding), list(shape.dilation), shape.groups)
        calls = {
            ("ours", "forward"): lambda: torch.ops.nnkernels.conv2d(x, weight, bias, *args),
            ("torch", "forward"): lambda: torch.nn.functional.conv2d(x, weight, bias, shape.stride, shape.padding,
                                                                     shape.dilation, shape.groups),
            ("ours", "backward"): lambda: torch.ops.nnkernels.conv2d_backward(dy, x, weight, *args, True, True,
                                                                              shape.bias),
            ("torch", "backward"): lambda: torch.ops.aten.convolution_backward(
                dy, x, weight, [shape.w_shape[0]] if shape.bias else None, *args[:3], False, [0, 0], shape.groups,
                [True, True, shape.bias]),
        }
        return {key: harness.time_ms(call) for key, call in calls.items()}
    finally:
        torch.backends.cudnn.allow_tf32 = previous


def model_totals(counts: dict, times: dict) -> dict:
    """{(model, precision, layout, pass): (ours ms, torch ms)}: per model the times of its layers, each weighted by
    how often the model holds it. `counts`: {model: Counter of ConvShape}; `times`: {(ConvShape, precision, layout):
    time_layer's dict}, every layer of every model in it."""
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for model, shapes in counts.items():
        for (shape, precision, layout), timed in times.items():
            if shape in shapes:
                for direction in ("forward", "backward"):
                    total = totals[model, precision, layout, direction]
                    total[0] += shapes[shape] * timed["ours", direction]
                    total[1] += shapes[shape] * timed["torch", direction]
    return {key: tuple(value) for key, value in totals.items()}


def run(quick: bool = False, models=None, batch: int = BATCH, precisions=DEFAULT_PRECISIONS,
        layouts=LAYOUTS) -> list[harness.Row]:
    """The rows of the module docstring: one per distinct layer, precision, layout and pass, then the models'
    weighted totals (case "<model> total", the layers summed)."""
    harness.require_gpu()
    models = list(models or MODELS)
    precisions, layouts = (("bf16",), ("nchw",)) if quick else (tuple(precisions), tuple(layouts))
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"precisions: expected some of {', '.join(PRECISIONS)}, got {', '.join(unknown)}")
    torch.backends.cudnn.benchmark = True
    counts = {model: model_shapes(model, batch) for model in models}
    shapes = list(dict.fromkeys(shape for model in models for shape in counts[model]))
    previous = torch.backends.cudnn.allow_tf32
    try:
        for precision in precisions:  # the kernels are those of NCHW inputs in either layout
            dtype, torch.backends.cudnn.allow_tf32 = PRECISIONS[precision]
            precompile_layers(shapes, dtype, WORKERS)
    finally:
        torch.backends.cudnn.allow_tf32 = previous
    times = {(shape, p, layout): time_layer(shape, p, layout)
             for shape in shapes for p in precisions for layout in layouts}
    rows = []
    for (shape, precision, layout), timed in times.items():
        held = ", ".join(f"{model} x{counts[model][shape]}" for model in models if shape in counts[model])
        for direction, work in (("forward", shape.flops()), ("backward", 2 * shape.flops())):
            rows.append(harness.Row("model_convs", f"{shape.name} ({held})", f"{precision} {layout}", direction,
                                    timed["ours", direction], timed["torch", direction], work, "TFLOP/s"))
    for (model, precision, layout, direction), (ours, theirs) in model_totals(counts, times).items():
        rows.append(harness.Row("model_convs", f"{model} total", f"{precision} {layout}", direction, ours, theirs,
                                0.0, "TFLOP/s", {"layers": sum(counts[model].values())}))
    return rows
