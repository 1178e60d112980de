"""Second derivatives (autograd with create_graph=True) through conv2d, avg_pool2d and batch_norm, against torch in
float64 on fresh random data.

The kernels take fp32, fp16 and bf16, so gradgradcheck's float64 finite differences are out of reach; instead the
first derivatives of L = sum(g * y) + sum(y^2) / 2 (made with create_graph=True) and the derivatives of
sum(first derivatives^2) with respect to every input are compared with torch's in float64, at fp32 tolerances.
Without create_graph the plans' own backward kernels run, as before (`last_kernels`).
"""
import pytest
import torch
import torch.nn.functional as F

from nnkernels.functional import avg_pool2d, batch_norm, common, conv2d, last_kernels
from support import DEVICE, assert_close, randn


@pytest.fixture(autouse=True)
def ieee_fp32(exact_fp32):
    """No TF32 on the GPU: fp32 results within fp32 tolerances of float64's."""
    yield


@pytest.fixture
def fresh_records(monkeypatch):
    """`last_kernels` forgets earlier tests' calls."""
    monkeypatch.setattr(common, "_LAST", {})


def derivatives(fn, inputs, seed=0):
    """(first derivatives of L, their graphs kept; derivatives of sum(first^2)), for each of `inputs` (each made a
    leaf that requires grad)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(device=y.device, dtype=y.dtype)
    first = torch.autograd.grad((g * y).sum() + (y * y).sum() / 2, leaves, create_graph=True)
    second = torch.autograd.grad(sum((d * d).sum() for d in first), leaves)
    return first, second


def assert_matches_torch(ours, theirs, inputs):
    """ours(*inputs) in fp32 and theirs(*inputs) in float64 have the same first and second derivatives."""
    first, second = derivatives(ours, inputs)
    first64, second64 = derivatives(theirs, [t.double() for t in inputs])
    for out, ref in zip(first + second, first64 + second64):
        assert_close(out, ref, tol=1e-5)


# ---------------------------------------------------------------- conv2d

CONVS = [
    pytest.param((2, 4, 7, 6), (3, 4, 3, 3), dict(stride=2, padding=1), id="stride2-pad1"),
    pytest.param((2, 4, 6, 6), (4, 2, 3, 2), dict(padding=2, dilation=2, groups=2), id="dilation2-groups2"),
    pytest.param((2, 4, 5, 5), (8, 1, 3, 3), dict(stride=(2, 1), padding=(0, 3), groups=4),
                 id="depthwise-x2-stride21-pad03"),
]


@pytest.mark.parametrize("x_shape, w_shape, options", CONVS)
def test_conv2d_second_derivatives_match_torch(x_shape, w_shape, options):
    """Stride 2 (dy zero-inserted, unreached rows padded), dilation with groups=2, depthwise with a channel
    multiplier and padding wider than the kernel (dx's input cropped): d/dx, d/dw and d/dbias of both orders."""
    inputs = [randn(*x_shape), randn(*w_shape), randn(w_shape[0])]
    assert_matches_torch(lambda x, w, b: conv2d(x, w, b, **options), lambda x, w, b: F.conv2d(x, w, b, **options),
                         inputs)


@pytest.mark.parametrize("differentiated", [(0, 2), (1, 2)], ids=["input-bias", "weight-bias"])
def test_conv2d_unbatched_second_derivatives_match_torch(differentiated):
    """Unbatched, with the input or the weight frozen: second derivatives in the others match torch's."""
    tensors = [randn(3, 5, 6), randn(2, 3, 2, 2), randn(2)]
    options = dict(stride=2, padding=1)

    def with_frozen(fn):
        def call(*leaves):
            inputs = list(tensors)
            for index, leaf in zip(differentiated, leaves):
                inputs[index] = leaf
            return fn(*[t.to(leaves[0].dtype) for t in inputs], **options)
        return call

    assert_matches_torch(with_frozen(conv2d), with_frozen(F.conv2d), [tensors[i] for i in differentiated])


@pytest.mark.parametrize("make_input", [lambda: randn(3, 5, 6), lambda: randn(2, 5, 6, 3).permute(0, 3, 1, 2)],
                         ids=["unbatched", "channels-last"])
def test_conv2d_second_derivatives_through_a_copied_input_match_torch(make_input):
    """An unbatched or non-contiguous input, which the plan reads as a 4-D view or a copy, with input, weight and
    bias all differentiated: the backward works on the caller's tensors, so dw's dependence on x is kept."""
    inputs = [make_input(), randn(2, 3, 2, 2), randn(2)]
    assert_matches_torch(lambda x, w, b: conv2d(x, w, b, padding=1), lambda x, w, b: F.conv2d(x, w, b, padding=1),
                         inputs)


def test_conv2d_empty_batch_second_derivatives_are_zeros():
    x, w = randn(0, 2, 4, 4).requires_grad_(), randn(3, 2, 3, 3).requires_grad_()
    dx, dw = torch.autograd.grad(conv2d(x, w, padding=1).sum(), (x, w), create_graph=True)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))
    (dw_w,) = torch.autograd.grad((dw * dw).sum() + dx.sum(), w, allow_unused=True)
    assert dw_w is None or torch.equal(dw_w, torch.zeros_like(w))


def test_conv2d_first_derivatives_take_the_plan_without_create_graph(fresh_records):
    """Without create_graph the plan's backward kernels run; with it, the same gradients come from forward
    convolutions (nnkernels' own) and the plan's backward does not run."""
    x, w, b = (randn(2, 3, 6, 6).requires_grad_(), randn(4, 3, 3, 3).requires_grad_(),
               randn(4).requires_grad_())
    y = conv2d(x, w, b, stride=2, padding=1)
    dy = randn(*y.shape)
    plain = torch.autograd.grad(y, (x, w, b), dy)
    assert last_kernels("conv2d")["backward"]
    common._LAST.clear()
    graphed = torch.autograd.grad(conv2d(x, w, b, stride=2, padding=1), (x, w, b), dy, create_graph=True)
    assert "backward" not in last_kernels("conv2d") and last_kernels("conv2d")["forward"]
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(F.conv2d(x64, w64, b64, stride=2, padding=1), (x64, w64, b64), dy.double())
    for out_plain, out_graphed, expected in zip(plain, graphed, ref):
        assert_close(out_plain, expected, tol=1e-5)
        assert_close(out_graphed, expected, tol=1e-5)


# ---------------------------------------------------------------- avg_pool2d

POOLS = [
    pytest.param(dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                 id="k3-s2-pad1-ceil-nopad"),
    pytest.param(dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), divisor_override=5), id="rect-divisor"),
    pytest.param(dict(kernel_size=2, ceil_mode=True), id="k2-ceil-include-pad"),
]


@pytest.mark.parametrize("options", POOLS)
def test_avg_pool2d_second_derivatives_match_torch(options):
    assert_matches_torch(lambda x: avg_pool2d(x, **options), lambda x: F.avg_pool2d(x, **options),
                         [randn(2, 3, 7, 6)])


def test_avg_pool2d_unbatched_second_derivatives_match_torch():
    assert_matches_torch(lambda x: avg_pool2d(x, 2, 1), lambda x: F.avg_pool2d(x, 2, 1), [randn(2, 5, 5)])


def test_avg_pool2d_first_derivatives_unchanged_by_create_graph(fresh_records):
    x = randn(2, 3, 6, 7).requires_grad_()
    y = avg_pool2d(x, 3, 2, 1, ceil_mode=True)
    dy = randn(*y.shape)
    (plain,) = torch.autograd.grad(y, x, dy)
    assert last_kernels("avg_pool2d")["backward"]
    (graphed,) = torch.autograd.grad(avg_pool2d(x, 3, 2, 1, ceil_mode=True), x, dy, create_graph=True)
    assert torch.equal(plain, graphed)


# ---------------------------------------------------------------- batch_norm

@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_batch_norm_second_derivatives_match_torch(training, affine):
    C = 3
    running_mean, running_var = randn(C), torch.rand(C, device=DEVICE) + 0.5
    stats = (lambda dtype: (running_mean.to(dtype), running_var.to(dtype)))

    def ours(x, *params):
        return batch_norm(x, *stats(torch.float32), *params, training=training)

    def theirs(x, *params):
        return F.batch_norm(x, *stats(torch.float64), *params, training=training)

    inputs = [randn(2, C, 4, 5)] + ([randn(C), randn(C)] if affine else [])
    assert_matches_torch(ours, theirs, inputs)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm_first_derivatives_take_the_plan_without_create_graph(training, fresh_records):
    C = 3
    x, w, b = randn(2, C, 4, 4).requires_grad_(), randn(C).requires_grad_(), randn(C).requires_grad_()
    stats = (None, None) if training else (randn(C), torch.rand(C, device=DEVICE) + 0.5)
    step = "train_backward" if training else "eval_backward"
    y = batch_norm(x, *stats, w, b, training=training)
    dy = randn(*y.shape)
    plain = torch.autograd.grad(y, (x, w, b), dy)
    assert last_kernels("batch_norm")[step]
    common._LAST.clear()
    graphed = torch.autograd.grad(batch_norm(x, *stats, w, b, training=training), (x, w, b), dy, create_graph=True)
    assert step not in last_kernels("batch_norm")
    for out_plain, out_graphed in zip(plain, graphed):
        assert_close(out_graphed, out_plain, tol=1e-5)
