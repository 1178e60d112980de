"""Special values and layouts: NaN and Inf propagate as PyTorch propagates them, batch 0 gives
empty results like PyTorch, and non-contiguous or channels_last tensors give PyTorch's values
(each op makes such inputs contiguous before launching: never reads them as if contiguous).

Every check runs forward and backward against PyTorch in float64 on the same inputs. For special
values the NaN, +Inf and -Inf positions must be exactly PyTorch's (one exception, Inf in a parameter,
is explained where it is made), and the finite elements within tolerance.
"""
import pytest
import torch
import torch.nn.functional as F
from support import CONV_TF32_TOLERANCE, DEVICE, DTYPES, TOLERANCE, assert_close, dtype_id, gpu, randn

import nnkernels.nn as nkn
from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d

INF, NAN = float("inf"), float("nan")


def tolerance(dtype, op):
    return CONV_TF32_TOLERANCE if op.startswith("conv2d") and dtype == torch.float32 else TOLERANCE[dtype]


def running_stats(C):
    return randn(C) * 0.1, randn(C).abs() + 0.5


# Each op as (ours, reference): f(x, params, stats) with params the differentiable extra inputs.
def conv_call(module):
    def call(x, params, stats):
        return module.conv2d(x, *params, stride=(2, 1), padding=1, dilation=(1, 2))
    return call


def channels_last_call(module):
    def call(x, params, stats):
        return module.conv2d(x, *params, padding=1)
    return call


def pointwise_call(module):
    def call(x, params, stats):
        return module.conv2d(x, *params)
    return call


def depthwise_call(module):
    def call(x, params, stats):
        return module.conv2d(x, *params, padding=1, groups=x.shape[1])
    return call


def pool_call(module):
    def call(x, params, stats):
        return module.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)
    return call


def bn_call(module, training):
    def call(x, params, stats):
        return module.batch_norm(x, *stats, *params, training=training, momentum=0.1, eps=1e-5)
    return call


class Ours:
    conv2d, avg_pool2d, batch_norm = staticmethod(conv2d), staticmethod(avg_pool2d), staticmethod(batch_norm)


OPS = {
    "conv2d": (conv_call(Ours), conv_call(F), lambda C: [randn(4, C, 3, 3), randn(4)]),
    # 1x1: a matrix product per image, in fp32 with TF32 on as three bf16 products of split values.
    "conv2d-pointwise": (pointwise_call(Ours), pointwise_call(F), lambda C: [randn(5, C, 1, 1), randn(5)]),
    "conv2d-depthwise": (depthwise_call(Ours), depthwise_call(F), lambda C: [randn(C, 1, 3, 3), randn(C)]),
    # 16 channels in and out, groups 1, stride 1: the channels-last kernels, dx as a convolution of dy.
    "conv2d-channels-last": (channels_last_call(Ours), channels_last_call(F),
                             lambda C: [randn(16, C, 3, 3), randn(16)]),
    "avg_pool2d": (pool_call(Ours), pool_call(F), lambda C: []),
    "batch_norm-train": (bn_call(Ours, True), bn_call(F, True), lambda C: [randn(C), randn(C)]),
    "batch_norm-eval": (bn_call(Ours, False), bn_call(F, False), lambda C: [randn(C), randn(C)]),
}


def run_both(op, x, params, dy_fn, dtype):
    """(ours, reference) lists: [y, grad of x, grads of params]; reference in float64 on the CPU."""
    ours_fn, ref_fn, _ = OPS[op]
    C = x.shape[1]
    stats = running_stats(C)
    leaves = [t.to(dtype).detach().requires_grad_() for t in [x] + params]
    refs = [t.detach().cpu().double().requires_grad_() for t in leaves]
    ref_stats = [s.detach().cpu().double() for s in stats]
    y = ours_fn(leaves[0], leaves[1:], [s.clone() for s in stats])
    ref = ref_fn(refs[0], refs[1:], ref_stats)
    dy = dy_fn(tuple(y.shape)).to(dtype)
    y.backward(dy)
    ref.backward(dy.detach().cpu().double())
    return [y] + [t.grad for t in leaves], [ref] + [t.grad for t in refs]


def assert_same_specials(out, ref, tol, what, exact_kind=True, may_spread=False):
    """The same NaN, +Inf and -Inf positions as PyTorch (only the same non-finite positions when not
    `exact_kind`), and the finite elements within `tol`. With `may_spread`, ours may be non-finite
    at more positions than PyTorch's, never fewer, and equal where both are finite."""
    out64, ref64 = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    if may_spread:
        missing = ~torch.isfinite(ref64) & torch.isfinite(out64)
        assert not missing.any(), f"{what}: finite at {int(missing.sum())} positions where PyTorch is not"
        both = torch.isfinite(ref64) & torch.isfinite(out64)
        assert_close(out64[both], ref64[both], tol=tol)
        return
    kinds = [("NaN", torch.isnan), ("+Inf", lambda t: t == INF), ("-Inf", lambda t: t == -INF)]
    for name, mask in kinds if exact_kind else [("non-finite", lambda t: ~torch.isfinite(t))]:
        got, want = mask(out64), mask(ref64)
        assert torch.equal(got, want), (
            f"{what}: {name} at {int(got.sum())} positions, PyTorch at {int(want.sum())}; "
            f"first difference at {tuple(torch.nonzero(got != want)[0].tolist())}"
        )
    finite = torch.isfinite(ref64)
    if finite.any():
        assert_close(out64[finite], ref64[finite], tol=tol)


SPECIALS = {  # id: (where, value)
    "nan-in-x": ("x", NAN),
    "inf-in-x": ("x", INF),
    "-inf-in-x": ("x", -INF),
    "inf-and--inf-in-x": ("x", "mixed"),
    "nan-in-dy": ("dy", NAN),
    "inf-in-dy": ("dy", INF),
    "nan-in-weight": ("param", NAN),
    "inf-in-weight": ("param", INF),
}
# Every case in fp32; the 16-bit types (whose kernels differ only in loads and stores) on one case each.
SPECIAL_CASES = [pytest.param(*case, torch.float32, id=name) for name, case in SPECIALS.items()] + [
    pytest.param("x", "mixed", dtype, id=f"inf-and--inf-in-x-{dtype_id(dtype)}") for dtype in DTYPES[1:]
]


@pytest.mark.parametrize("op, where, value, dtype", [
    pytest.param(op, *case.values, id=f"{op}-{case.id}") for op in OPS for case in SPECIAL_CASES
    if not (op == "avg_pool2d" and case.values[0] == "param")  # pooling has no parameter to poison
])
def test_special_values_propagate_like_pytorch(op, where, value, dtype):
    C = 16 if op == "conv2d-channels-last" else 3
    x = randn(2, C, 7, 6)
    params = OPS[op][2](C)
    if where == "x":
        # Specials at a corner, an edge and the middle: padding and window borders must not hide or spread them.
        for (b, c, h, w), v in zip([(0, 0, 0, 0), (1, 1, 3, 5), (1, 2, 6, 2)],
                                   [value, value, value] if value != "mixed" else [INF, -INF, INF]):
            x[b, c, h, w] = v
    if where == "param":
        params[0].view(-1)[1] = value

    def dy_fn(shape):
        dy = randn(*shape)
        if where == "dy":
            dy.view(-1)[5] = value
        return dy

    ours, refs = run_both(op, x, params, dy_fn, dtype)
    names = ["y", "dx"] + [f"dparam{i}" for i in range(len(params))]
    for name, out, ref in zip(names, ours, refs):
        # With Inf in a parameter PyTorch's reference folds weight and statistics into x * scale + shift, so
        # Inf - Inf makes NaN where weight * xhat is +-Inf: which non-finite value comes out is the formula's
        # artefact there, so only the non-finite positions must agree.
        exact_kind = not (where == "param" and value == INF)
        # A documented deviation: the implicit-GEMM dx kernels multiply the zeros that stand for dy
        # outside the image by every weight of the tap, so a NaN/Inf weight also reaches dx where its
        # tap only meets padding (PyTorch's col2im drops those terms). Everything PyTorch makes
        # non-finite must be non-finite here too, and the finite values must agree.
        may_spread = where == "param" and name == "dx" and op in ("conv2d", "conv2d-channels-last")
        assert_same_specials(out, ref, tolerance(dtype, op), f"{op} {name}", exact_kind, may_spread)



@pytest.mark.parametrize("op", ["conv2d", "conv2d-channels-last"])
@pytest.mark.parametrize("value", [NAN, INF, "mixed"], ids=["nan", "inf", "inf-and--inf"])
def test_special_values_in_full_fp32_convolution(op, value):
    """With TF32 off the tensor-core kernels split each fp32 value into a TF32 part and a remainder
    (tf32x3), and the remainder of an Inf is NaN: those must not leak into the results."""
    C = 16 if op == "conv2d-channels-last" else 3
    x, params = randn(2, C, 7, 6), OPS[op][2](C)
    for (b, c, h, w), v in zip([(0, 0, 0, 0), (1, 1, 3, 5), (1, 2, 6, 2)],
                               [value] * 3 if value != "mixed" else [INF, -INF, INF]):
        x[b, c, h, w] = v
    with torch.backends.cudnn.flags(allow_tf32=False):
        ours, refs = run_both(op, x, params, lambda shape: randn(*shape), torch.float32)
    for name, out, ref in zip(["y", "dx", "dweight", "dbias"], ours, refs):
        assert_same_specials(out, ref, TOLERANCE[torch.float32], f"{op} {name}")


# ---- batch 0 ----

def test_conv2d_batch_0_is_empty_like_pytorch():
    x = randn(0, 3, 5, 5).requires_grad_()
    w, b = randn(4, 3, 3, 3).requires_grad_(), randn(4).requires_grad_()
    y = conv2d(x, w, b, padding=1)
    assert y.shape == (0, 4, 5, 5)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_avg_pool2d_batch_0_is_empty_like_pytorch():
    x = randn(0, 3, 5, 5).requires_grad_()
    y = avg_pool2d(x, 3, 2, 1, ceil_mode=True)
    assert y.shape == F.avg_pool2d(x.detach(), 3, 2, 1, ceil_mode=True).shape == (0, 3, 3, 3)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_batch_0_is_empty_like_pytorch(training):
    """PyTorch: an empty result, zero parameter gradients, running statistics left as they were."""
    x = randn(0, 3, 4, 4).requires_grad_()
    w, b = randn(3).requires_grad_(), randn(3).requires_grad_()
    running_mean, running_var = running_stats(3)
    before = running_mean.clone(), running_var.clone()
    y = batch_norm(x, running_mean, running_var, w, b, training=training)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    assert torch.equal(running_mean, before[0]) and torch.equal(running_var, before[1])


@pytest.mark.parametrize("layer, args", [
    pytest.param(nkn.Conv2d, (3, 4, 3), id="Conv2d"),
    pytest.param(nkn.AvgPool2d, (2,), id="AvgPool2d"),
    pytest.param(nkn.BatchNorm2d, (3,), id="BatchNorm2d"),
])
def test_modules_batch_0_is_empty_like_pytorch(layer, args):
    ours, torch_layer = layer(*args).to(DEVICE), getattr(torch.nn, layer.__name__)(*args).to(DEVICE)
    torch_layer.load_state_dict(ours.state_dict())
    x = randn(0, 3, 4, 4)
    assert ours(x).shape == torch_layer(x).shape


# ---- layouts ----

def layouts(x):
    """(name, tensor equal to x, laid out otherwise): none of them contiguous in NCHW order."""
    B, C, H, W = x.shape
    wide = randn(B, C, H, 2 * W)
    wide[..., ::2] = x
    padded = randn(B + 1, C, H, W)
    padded[1:] = x
    return [
        ("channels_last", x.to(memory_format=torch.channels_last)),
        ("strided-columns", wide[..., ::2]),
        ("transposed-hw", x.transpose(2, 3).contiguous().transpose(2, 3)),
        ("storage-offset", padded[1:]),  # contiguous, but not at the start of its storage
        ("broadcast-batch", x[:1].expand(B, C, H, W)),  # stride 0: every image is the same memory
    ]


LAYOUT_NAMES = [name for name, _ in layouts(torch.zeros(2, 1, 1, 1))]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
# conv2d makes its inputs contiguous before choosing a kernel, so its other kernels need no second run.
@pytest.mark.parametrize("op", [op for op in OPS if op not in ("conv2d-depthwise", "conv2d-channels-last")])
def test_non_contiguous_input_and_grad_output(op, layout):
    """x, and the gradient flowing back into the op, in a layout other than contiguous NCHW."""
    x = randn(2, 3, 7, 6)
    if layout == "broadcast-batch":
        x[1] = x[0]
    x_laid = dict(layouts(x))[layout]
    assert torch.equal(x_laid, x) and (layout == "storage-offset" or not x_laid.is_contiguous())
    params = OPS[op][2](3)

    def dy_fn(shape):
        return dict(layouts(randn(*shape)))[layout]

    ours, refs = run_both(op, x_laid, params, dy_fn, torch.float32)
    for name, out, ref in zip(["y", "dx", "dparam0", "dparam1"], ours, refs):
        assert_close(out, ref, tol=tolerance(torch.float32, op))


def test_conv2d_non_contiguous_weight_and_bias():
    """Weights in every layout (model.to(memory_format=torch.channels_last) makes them channels_last),
    forward and backward."""
    x = randn(2, 3, 6, 5)
    for name, w in layouts(randn(4, 3, 3, 3)):
        w.requires_grad_()
        bias = randn(8)[::2].requires_grad_()
        y = conv2d(x, w, bias, padding=1)
        refs = [t.detach().double().cpu().requires_grad_() for t in (w, bias)]
        ref = F.conv2d(x.double().cpu(), *refs, padding=1)
        assert_close(y, ref, tol=CONV_TF32_TOLERANCE)
        dy = randn(*y.shape)
        y.backward(dy)
        ref.backward(dy.double().cpu())
        for got, want in zip((w.grad, bias.grad), (refs[0].grad, refs[1].grad)):
            assert_close(got, want, tol=CONV_TF32_TOLERANCE)


def test_batch_norm_strided_parameters():
    x = randn(2, 3, 4, 5)
    w, b = randn(6)[::2], randn(6)[1::2]
    running_mean, running_var = running_stats(3)
    for training in (True, False):
        y = batch_norm(x, running_mean.clone(), running_var.clone(), w, b, training=training)
        ref = F.batch_norm(x.double().cpu(), running_mean.double().cpu(), running_var.double().cpu(),
                           w.double().cpu(), b.double().cpu(), training=training)
        assert_close(y, ref, tol=TOLERANCE[torch.float32])


# ---- batch-norm statistics far from zero ----

@pytest.mark.parametrize("offset, scale", [(1e3, 1e-2), (1e4, 1.0)], ids=["mean-1e3-std-1e-2", "mean-1e4-std-1"])
def test_batch_norm_large_mean_small_variance(offset, scale):
    """A naive E[x^2] - E[x]^2 loses every digit of the variance here; a constant channel (variance 0)
    must normalise to exactly 0 (y = bias), where a variance rounded below 0 would give NaN."""
    x = randn(4, 3, 8, 8) * scale + offset
    x[:, 1] = offset + 0.25
    w, b = randn(3), randn(3)
    running_mean, running_var = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    y = batch_norm(x, running_mean, running_var, w, b, training=True)
    ref_stats = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    ref = F.batch_norm(x.double().cpu(), *ref_stats, w.double().cpu(), b.double().cpu(), training=True)
    assert_close(y, ref, tol=TOLERANCE[torch.float32])
    assert torch.equal(y[:, 1].cpu(), b[1].cpu().expand(4, 8, 8)), "a constant channel must give y = bias"
    assert_close(running_mean, ref_stats[0], tol=TOLERANCE[torch.float32])
    assert_close(running_var, ref_stats[1], tol=TOLERANCE[torch.float32])


# ---- a batch larger than CUDA's 65535 on a grid's y or z axis ----

@gpu
@pytest.mark.parametrize("op", ["conv2d-pointwise", "conv2d-3x3", "conv2d-depthwise", "avg_pool2d", "batch_norm-train",
                                "batch_norm-eval"])
def test_batch_beyond_65535_like_pytorch(op):
    """PyTorch takes any batch; a kernel with the batch on a grid axis capped at 65535 must not refuse it.
    (GPU only: the interpreter would run one program per image.)"""
    C = 4
    x = randn(70000, C, 2, 2).requires_grad_()
    params = {"conv2d-pointwise": [randn(6, C, 1, 1)], "conv2d-3x3": [randn(6, C, 3, 3)],
              "conv2d-depthwise": [randn(C, 1, 3, 3)]}.get(op, [randn(C), randn(C)] if op.startswith("batch") else [])
    params = [p.requires_grad_() for p in params]
    refs = [t.detach().double().cpu().requires_grad_() for t in [x] + params]
    stats = running_stats(C)
    if op == "conv2d-pointwise":
        y, ref = conv2d(x, *params), F.conv2d(*refs)
    elif op.startswith("conv2d"):
        groups = C if op == "conv2d-depthwise" else 1
        y, ref = conv2d(x, *params, padding=1, groups=groups), F.conv2d(*refs, padding=1, groups=groups)
    elif op == "avg_pool2d":
        y, ref = avg_pool2d(x, 2), F.avg_pool2d(refs[0], 2)
    else:
        training = op == "batch_norm-train"
        y = batch_norm(x, *[s.clone() for s in stats], *params, training=training)
        ref = F.batch_norm(refs[0], *[s.double().cpu() for s in stats], *refs[1:], training=training)
    dy = randn(*y.shape)
    y.backward(dy)
    ref.backward(dy.double().cpu())
    tol = tolerance(torch.float32, op)
    assert_close(y, ref, tol=tol)
    for got, want in zip([x] + params, refs):
        assert_close(got.grad, want.grad, tol=tol)
