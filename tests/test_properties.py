"""Property-based tests: hypothesis draws shapes and options, each functional op (conv2d, conv_transpose2d,
avg_pool2d, batch_norm) must match PyTorch in float64 (forward, backward and, for batch norm, the running
statistics).

The drawn space covers 1x1 images, batch 1, channel counts that are multiples of nothing (and,
for the channels-last convolution path, multiples of 16; channels-last tensors of 8 to 24 channels too),
kernels as large as the padded input, strides, paddings ("same" and "valid" too), dilations, groups (depthwise
included), ceil_mode, count_include_pad, divisor_override, 3-D (unbatched) and 2-D input, and
fp32/fp16/bf16. Data is fresh random normal (never zeros), seeded by hypothesis so a failure
replays. Reference: the op's own inputs (already rounded to the dtype) in float64 through
torch.nn.functional; tolerance: support.TOLERANCE on ||out - ref|| / ||ref||.

Profiles, chosen by NNKERNELS_HYPOTHESIS_PROFILE:
- "ci" (default): few examples of small shapes, for the interpreter in CI (under 60 CPU-seconds
  for this file on 2 cores);
- "gpu": more examples of larger shapes, for a run on the GPU
  (`NNKERNELS_HYPOTHESIS_PROFILE=gpu NNKERNELS_TUNE=off pytest -n 3 tests/test_properties.py`;
  NNKERNELS_TUNE=off spares the tuning of each new shape, which would compile and time several
  block sizes; -n 3 runs the three ops' tests side by side).
fp32 convolutions on the GPU follow torch.backends.cudnn.allow_tf32 (on by default) and are held
to 2e-3, TF32's rounding; everything else to support.TOLERANCE.
"""
import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import CONV_TF32_TOLERANCE, DEVICE, TOLERANCE, assert_close

from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d
from nnkernels.functional.conv_transpose import conv_transpose2d

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
              print_blob=True)
settings.register_profile("ci", max_examples=12, **COMMON)
# On the GPU nearly every conv example is a new set of constants, so a new compilation of ~3 kernels
# (~1 s each): 40 examples (60 for the cheaper ops) keep the run to a few minutes.
settings.register_profile("gpu", max_examples=40, **COMMON)
PROFILE = os.environ.get("NNKERNELS_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "gpu"):
    raise ValueError(f"NNKERNELS_HYPOTHESIS_PROFILE: expected 'ci' or 'gpu', got {PROFILE!r}")
LARGE = PROFILE == "gpu"
# Per-op example counts relative to the profile's (convolution is the slowest to interpret).
EXAMPLES = {"conv2d": 1.0, "conv_transpose2d": 1.0, "avg_pool2d": 1.5, "batch_norm": 1.5}
# Largest drawn sizes: the interpreter pays per launch and per program, the GPU per compilation.
MAX_BATCH, MAX_CHANNELS, MAX_EXTRA = (4, 40, 24) if LARGE else (3, 5, 4)

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def examples(op):
    return settings(settings.get_profile(PROFILE), max_examples=int(settings.get_profile(PROFILE).max_examples
                                                                     * EXAMPLES[op]))


def random_tensor(generator, shape, dtype):
    return torch.randn(shape, generator=generator).to(device=DEVICE, dtype=dtype)


def conv_tolerance(dtype):
    tf32 = dtype == torch.float32 and torch.backends.cudnn.allow_tf32
    return CONV_TF32_TOLERANCE if tf32 else TOLERANCE[dtype]


def check_grads(inputs, outputs_fn, ref_fn, dtype, tol, generator, grad_floors=None, magnitudes=None):
    """Forward and backward of `outputs_fn(*inputs)` against `ref_fn(*float64 copies)` (same dy).

    `grad_floors(dy64, refs)`, if given, gives for each input the scale its gradient is judged on
    (support.assert_close's `floor`); `magnitudes`, the op taking the inputs' absolute values, gives the
    output's: an output that sums terms of both signs rounds on the scale of its terms, not of the sum (a 4x4
    mean of random values can land on 2e-4, where fp32's rounding of the terms is relatively 2e-5)."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    refs = [t.detach().cpu().double().requires_grad_() if t is not None else None for t in inputs]
    y = outputs_fn(*leaves)
    ref = ref_fn(*refs)
    assert y.dtype == dtype
    with torch.no_grad():
        scale = magnitudes(*(None if t is None else t.abs() for t in refs)).norm().item() if magnitudes else 0.0
    assert_close(y, ref, tol=tol, floor=scale)
    dy = random_tensor(generator, tuple(y.shape), dtype)
    y.backward(dy)
    ref.backward(dy.cpu().double())
    for index, (got, want) in enumerate(zip(leaves, refs)):
        if got is not None:
            assert got.grad is not None, f"input {index}: no gradient"
            floor = grad_floors(dy.cpu().double(), refs)[index] if grad_floors else 0.0
            assert_close(got.grad, want.grad, tol=tol, floor=floor)


def check_conv_grads(op, torch_op, x, w, b, options, dtype, generator):
    """`check_grads` of op(x, w, b, **options) against torch_op's in float64 at the convolution tolerance, the
    output judged on the scale of its terms (torch_op of the magnitudes)."""
    def reference(x, w, b):
        return torch_op(x, w, b, **options)

    check_grads((x, w, b), lambda x, w, b: op(x, w, b, **options), reference, dtype, conv_tolerance(dtype), generator,
                magnitudes=reference)


@st.composite
def conv_problems(draw):
    # The op's paths: depthwise; 1x1 stride-1 unpadded one-group (pointwise); channels-last implicit GEMM
    # (groups 1, channels multiple of 16); NCHW implicit GEMM (everything else).
    path = draw(st.sampled_from(["depthwise", "pointwise", "channels-last", "nchw"]))
    if path == "depthwise":
        groups, cin_per_group, cout_per_group = draw(st.integers(1, MAX_CHANNELS)), 1, 1
    elif path == "channels-last":
        groups = 1
        cin_per_group, cout_per_group = (16 * draw(st.integers(1, 4 if LARGE else 2)) for _ in range(2))
    else:
        groups = 1 if path == "pointwise" else draw(st.integers(1, 3))
        cin_per_group, cout_per_group = (draw(st.integers(1, MAX_CHANNELS)) for _ in range(2))
    kernel = [draw(st.integers(1, 5)) for _ in range(2)]
    stride = [draw(st.integers(1, 3)) for _ in range(2)]
    dilation = [draw(st.integers(1, 2)) for _ in range(2)]
    padding = [draw(st.integers(0, 2)) for _ in range(2)]
    if path == "pointwise":
        kernel, stride, padding = [1, 1], [1, 1], [0, 0]
    # The input is at least the dilated kernel less the padding; extra 0 puts the kernel over the whole padded input.
    size = [max(1, d * (k - 1) + 1 - 2 * p + draw(st.integers(0, MAX_EXTRA)))
            for k, p, d in zip(kernel, padding, dilation)]
    # PyTorch's string paddings: "valid" is 0; "same" (stride 1 only) pads asymmetrically for even spans.
    named = draw(st.sampled_from([None, None, None, "valid", "same"]))
    if named == "same":
        stride = [1, 1]
    if named == "valid":
        size = [max(s, d * (k - 1) + 1) for s, k, d in zip(size, kernel, dilation)]
    return dict(
        batch=draw(st.integers(1, MAX_BATCH)), c_in=cin_per_group * groups, c_out=cout_per_group * groups,
        size=size, kernel=kernel, stride=stride, padding=named or padding, dilation=dilation, groups=groups,
        bias=draw(st.booleans()), unbatched=draw(st.integers(0, 5)) == 0, dtype=draw(DTYPES),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@examples("conv2d")
@given(conv_problems())
def test_conv2d_matches_pytorch(p):
    generator = torch.Generator().manual_seed(p["seed"])
    dtype = p["dtype"]
    batch = () if p["unbatched"] else (p["batch"],)
    x = random_tensor(generator, batch + (p["c_in"], *p["size"]), dtype)
    w = random_tensor(generator, (p["c_out"], p["c_in"] // p["groups"], *p["kernel"]), dtype)
    b = random_tensor(generator, (p["c_out"],), dtype) if p["bias"] else None
    options = dict(stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    check_conv_grads(conv2d, F.conv2d, x, w, b, options, dtype, generator)


@st.composite
def channels_last_conv_problems(draw):
    # One group on channels-last tensors with channel counts of 8 or more, multiples of 16 or not: the
    # channels-last kernels, the last K slice of a tap masked where 16 does not divide the channels.
    top = 40 if LARGE else 24
    kernel = [draw(st.integers(1, 3)) for _ in range(2)]
    padding = [draw(st.integers(0, k // 2 + 1)) for k in kernel]
    stride = [draw(st.integers(1, 2)) for _ in range(2)]
    size = [max(k, draw(st.integers(1, 2 + MAX_EXTRA))) for k in kernel]
    return dict(batch=draw(st.integers(1, MAX_BATCH)), c_in=draw(st.integers(8, top)), c_out=draw(st.integers(8, top)),
                size=size, kernel=kernel, stride=stride, padding=padding, bias=draw(st.booleans()),
                dtype=draw(DTYPES), seed=draw(st.integers(0, 2**31 - 1)))


@settings(settings.get_profile(PROFILE), max_examples=max(4, settings.get_profile(PROFILE).max_examples // 2))
@given(channels_last_conv_problems())
def test_channels_last_conv2d_matches_pytorch(p):
    """Channels-last x in, y and dx out in the layouts torch gives them (channels-last, but for an x of 1x1 planes,
    which is contiguous too and gives NCHW), values against float64."""
    generator = torch.Generator().manual_seed(p["seed"])
    dtype = p["dtype"]
    x = random_tensor(generator, (p["batch"], p["c_in"], *p["size"]), dtype).contiguous(
        memory_format=torch.channels_last)
    w = random_tensor(generator, (p["c_out"], p["c_in"], *p["kernel"]), dtype)
    b = random_tensor(generator, (p["c_out"],), dtype) if p["bias"] else None
    options = dict(stride=p["stride"], padding=p["padding"])
    ours, theirs = x.detach().requires_grad_(), x.detach().double().requires_grad_()  # .double() keeps the layout
    y = conv2d(ours, w, b, **options)
    torch_y = F.conv2d(theirs, w.double(), None if b is None else b.double(), **options)
    dy = random_tensor(generator, tuple(y.shape), dtype).contiguous(memory_format=torch.channels_last)
    y.backward(dy)
    torch_y.backward(dy.double())
    for mine, torchs in ((y, torch_y), (ours.grad, theirs.grad)):
        assert mine.stride() == torchs.stride(), (mine.stride(), torchs.stride())
    check_conv_grads(conv2d, F.conv2d, x, w, b, options, dtype, generator)


@st.composite
def transpose_problems(draw):
    # output_padding below the stride (what nnkernels runs); padding cut so that the output has a pixel.
    groups = draw(st.integers(1, 3))
    cin_per_group, cout_per_group = (draw(st.integers(1, MAX_CHANNELS)) for _ in range(2))
    kernel, stride, dilation = ([draw(st.integers(1, top)) for _ in range(2)] for top in (4, 3, 2))
    output_padding = [draw(st.integers(0, step - 1)) for step in stride]
    size = [draw(st.integers(1, 2 + MAX_EXTRA)) for _ in range(2)]
    padding = [min(draw(st.integers(0, 2)), ((n - 1) * step + d * (k - 1) + op) // 2)
               for n, step, d, k, op in zip(size, stride, dilation, kernel, output_padding)]
    return dict(
        batch=draw(st.integers(1, MAX_BATCH)), c_in=cin_per_group * groups, c_out=cout_per_group * groups,
        size=size, kernel=kernel, stride=stride, padding=padding, output_padding=output_padding,
        dilation=dilation, groups=groups, bias=draw(st.booleans()), unbatched=draw(st.integers(0, 5)) == 0,
        dtype=draw(DTYPES), seed=draw(st.integers(0, 2**31 - 1)),
    )


@examples("conv_transpose2d")
@given(transpose_problems())
def test_conv_transpose2d_matches_pytorch(p):
    generator = torch.Generator().manual_seed(p["seed"])
    dtype = p["dtype"]
    batch = () if p["unbatched"] else (p["batch"],)
    x = random_tensor(generator, batch + (p["c_in"], *p["size"]), dtype)
    w = random_tensor(generator, (p["c_in"], p["c_out"] // p["groups"], *p["kernel"]), dtype)
    b = random_tensor(generator, (p["c_out"],), dtype) if p["bias"] else None
    options = dict(stride=p["stride"], padding=p["padding"], output_padding=p["output_padding"], groups=p["groups"],
                   dilation=p["dilation"])
    check_conv_grads(conv_transpose2d, F.conv_transpose2d, x, w, b, options, dtype, generator)


@st.composite
def pool_problems(draw):
    kernel = [draw(st.integers(1, 5)) for _ in range(2)]
    stride = None if draw(st.booleans()) else [draw(st.integers(1, 4)) for _ in range(2)]
    padding = [draw(st.integers(0, k // 2)) for k in kernel]
    size = [max(1, k - 2 * p + draw(st.integers(0, MAX_EXTRA))) for k, p in zip(kernel, padding)]
    return dict(
        batch=draw(st.integers(1, MAX_BATCH)), channels=draw(st.integers(1, MAX_CHANNELS)), size=size,
        kernel=kernel, stride=stride, padding=padding, ceil_mode=draw(st.booleans()),
        count_include_pad=draw(st.booleans()), divisor=draw(st.one_of(st.none(), st.integers(1, 30))),
        unbatched=draw(st.integers(0, 5)) == 0, dtype=draw(DTYPES), seed=draw(st.integers(0, 2**31 - 1)),
    )


@examples("avg_pool2d")
@given(pool_problems())
def test_avg_pool2d_matches_pytorch(p):
    generator = torch.Generator().manual_seed(p["seed"])
    batch = () if p["unbatched"] else (p["batch"],)
    x = random_tensor(generator, batch + (p["channels"], *p["size"]), p["dtype"])
    options = (p["kernel"], p["stride"], p["padding"], p["ceil_mode"], p["count_include_pad"], p["divisor"])
    check_grads(
        (x,),
        lambda x: avg_pool2d(x, *options),
        lambda x: F.avg_pool2d(x, *options),
        p["dtype"], TOLERANCE[p["dtype"]], generator, magnitudes=lambda x: F.avg_pool2d(x, *options),
    )


@st.composite
def batch_norm_problems(draw):
    dtype = draw(DTYPES)
    training = draw(st.booleans())
    batch = draw(st.integers(1, MAX_BATCH))
    spatial = draw(st.sampled_from([(), (1, 1), None]))
    if spatial is None:
        spatial = tuple(draw(st.integers(1, 3 + MAX_EXTRA)) for _ in range(2))
    if training and batch * max(1, int(torch.tensor(spatial).prod())) == 1:
        batch = 2  # PyTorch refuses one value per channel in training; tested in test_bad_inputs.py
    return dict(
        shape=(batch, draw(st.integers(1, MAX_CHANNELS))) + spatial, training=training,
        track=draw(st.booleans()) if training else True, affine=draw(st.booleans()),
        param_dtype=draw(st.sampled_from([dtype, torch.float32])), dtype=dtype,
        momentum=draw(st.floats(0.0, 1.0)), eps=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@examples("batch_norm")
@given(batch_norm_problems())
def test_batch_norm_matches_pytorch(p):
    generator = torch.Generator().manual_seed(p["seed"])
    dtype, C = p["dtype"], p["shape"][1]
    # A per-channel offset and scale, so mean and variance are not 0 and 1 already.
    x = (random_tensor(generator, p["shape"], torch.float32) * 3 + 2).to(dtype)
    weight = random_tensor(generator, (C,), p["param_dtype"]) if p["affine"] else None
    bias = random_tensor(generator, (C,), p["param_dtype"]) if p["affine"] else None
    running_mean = random_tensor(generator, (C,), torch.float32) if p["track"] else None
    running_var = random_tensor(generator, (C,), torch.float32).abs() + 0.5 if p["track"] else None
    ref_mean = None if running_mean is None else running_mean.cpu().double()
    ref_var = None if running_var is None else running_var.cpu().double()
    options = dict(training=p["training"], momentum=p["momentum"], eps=p["eps"])

    def grad_scales(dy, refs):
        """The sizes of the terms each gradient sums, which can cancel to ~0: ||weight * rstd * dy||
        for dx (over a batch of two values), per channel sum |dy * xhat| for dweight and sum |dy|
        for dbias (an fp32 sum of terms near 1 that lands near 0.07 is off by ~1e-5 of itself)."""
        x64, w64 = refs[0].detach(), refs[1]
        dims = [d for d in range(x64.dim()) if d != 1]
        shape = [1, C] + [1] * (x64.dim() - 2)
        mean = x64.mean(dim=dims) if p["training"] else ref_mean
        var = x64.var(dim=dims, unbiased=False) if p["training"] else ref_var
        rstd = (var + p["eps"]).rsqrt().view(shape)
        scale = rstd * (w64.detach().abs().view(shape) if w64 is not None else 1.0)
        xhat = (x64 - mean.view(shape)) * rstd
        return ((dy * scale).norm().item(), (dy * xhat).abs().sum(dim=dims).norm().item(),
                dy.abs().sum(dim=dims).norm().item())

    check_grads(
        (x, weight, bias),
        lambda x, w, b: batch_norm(x, running_mean, running_var, w, b, **options),
        lambda x, w, b: F.batch_norm(x, ref_mean, ref_var, w, b, **options),
        dtype, TOLERANCE[dtype], generator, grad_floors=grad_scales,
    )
    if p["track"]:
        # fp32 statistics of a 16-bit input: the mean is exact to fp32, the variance to the dtype's rounding.
        assert_close(running_mean, ref_mean, tol=TOLERANCE[torch.float32] * 10)
        assert_close(running_var, ref_var, tol=TOLERANCE[torch.float32] * 10)

