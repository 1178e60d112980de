"""nnkernels.avg_pool2d and nnkernels.batch_norm against torch.nn.functional: values, gradients,
running statistics, errors (with nothing written), the custom operators (opcheck), torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from nnkernels.functional import last_kernels
from support import DEVICE, DTYPES, assert_close, gpu, randn
from nnkernels.functional import pooling as pool
from nnkernels.functional import batchnorm as bn

STATS_TOL = 2e-5


def assert_backward_matches(y, ref, leaves, ref_leaves):
    """y and its float64 reference `ref` backward through the same random dy (y's shape and dtype): the input's
    gradient (the first leaf) within its dtype's tolerance, batch norm's fp32 dweight and dbias within STATS_TOL."""
    dy = randn(*y.shape, dtype=y.dtype)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(leaves[0].grad, ref_leaves[0].grad)
    for leaf, ref_leaf in zip(leaves[1:], ref_leaves[1:]):
        assert_close(leaf.grad, ref_leaf.grad, tol=STATS_TOL)


# ---------------------------------------------------------------- avg_pool2d

@pytest.mark.parametrize("args, kwargs", [
    ((3,), {}),
    (((3, 2), (2, 1), (1, 0)), {"ceil_mode": True, "count_include_pad": False}),
    ((3, 2, 1), {"ceil_mode": True, "divisor_override": 4}),
], ids=["k3-default-stride", "rect-ceil-nopad", "divisor"])
def test_avg_pool2d_values_and_gradient(args, kwargs):
    x = randn(2, 3, 7, 8).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y, ref = pool.avg_pool2d(x, *args, **kwargs), F.avg_pool2d(x64, *args, **kwargs)
    assert_close(y, ref)
    assert_backward_matches(y, ref, (x,), (x64,))
    kernels = last_kernels("avg_pool2d")
    assert kernels["forward"][0].startswith(("avg_pool2d_gather_forward", "avg_pool2d_lanes_forward"))
    assert kernels["backward"][0].startswith(("avg_pool2d_gather_backward", "avg_pool2d_lanes_backward"))


def test_avg_pool2d_takes_an_unbatched_input_and_half_types():
    x = randn(3, 6, 6, dtype=torch.bfloat16)
    assert_close(pool.avg_pool2d(x, 2), F.avg_pool2d(x.double(), 2), torch.bfloat16)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"kernel_size": 2, "padding": 2}, ValueError, "padding"),
    ({"kernel_size": (2, 2, 2)}, TypeError, "kernel_size"),
    ({"kernel_size": 0}, ValueError, "kernel_size"),
    ({"kernel_size": 2, "stride": 0}, ValueError, "stride"),
    ({"kernel_size": 2, "divisor_override": 0}, ValueError, "divisor_override"),
    ({"kernel_size": 9}, ValueError, "smaller than kernel_size"),
    ({"kernel_size": 2, "ceil_mode": "no"}, TypeError, "ceil_mode"),
])
def test_avg_pool2d_refuses_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        pool.avg_pool2d(randn(1, 2, 4, 4), **kwargs)
    with pytest.raises(TypeError, match="x"):
        pool.avg_pool2d(torch.ones(1, 2, 4, 4, dtype=torch.int32, device=DEVICE), 2)


def test_avg_pool2d_custom_ops_pass_opcheck():
    x = randn(1, 2, 5, 5).requires_grad_()
    torch.library.opcheck(pool.avg_pool2d_op, (x, [3, 3], [2, 2], [1, 1], True, False, 0))
    torch.library.opcheck(pool.avg_pool2d_backward_op, (randn(1, 2, 3, 3), 5, 5, [3, 3], [2, 2], [1, 1], True, False,
                                                        2))


# ---------------------------------------------------------------- batch_norm

def _module_pair(C, momentum=0.1):
    """Running statistics for ours and a float64 copy for PyTorch's reference."""
    running_mean, running_var = randn(C), randn(C).abs() + 0.5
    return (running_mean, running_var), (running_mean.double().clone(), running_var.double().clone())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum", [0.1, 0.75])
def test_batch_norm_training_updates_running_stats_like_pytorch(dtype, momentum):
    C = 3
    x = (randn(4, C, 3, 5) * 2 - 1).to(dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    (rm, rv), (rm64, rv64) = _module_pair(C)
    y = bn.batch_norm(x, rm, rv, weight, bias, training=True, momentum=momentum, eps=1e-3)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    ref = F.batch_norm(x64, rm64, rv64, w64, b64, training=True, momentum=momentum, eps=1e-3)
    assert rm.dtype == rv.dtype == torch.float32
    assert_close(rm, rm64, tol=STATS_TOL)
    assert_close(rv, rv64, tol=STATS_TOL)
    assert_close(y, ref, dtype)
    assert_backward_matches(y, ref, (x, weight, bias), (x64, w64, b64))


def test_batch_norm_fp32_running_stats_match_pytorch_fp32():
    """Same inputs through PyTorch in fp32: the running statistics agree to fp32 rounding."""
    x = randn(8, 4, 5, 5) * 3 + 2
    (rm, rv), _ = _module_pair(4)
    torch_rm, torch_rv = rm.clone(), rv.clone()
    bn.batch_norm(x, rm, rv, training=True)
    F.batch_norm(x, torch_rm, torch_rv, training=True)
    torch.testing.assert_close(rm, torch_rm, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rv, torch_rv, rtol=1e-6, atol=1e-6)


def test_batch_norm_training_without_running_stats_or_affine():
    x = randn(5, 3, 4).requires_grad_()
    y = bn.batch_norm(x, None, None, training=True)
    x64 = x.detach().double().requires_grad_()
    ref = F.batch_norm(x64, None, None, training=True)
    assert_close(y, ref)
    assert_backward_matches(y, ref, (x,), (x64,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_eval_uses_running_stats_and_leaves_them(dtype):
    C = 4
    x = randn(2, C, 3, 3, dtype=dtype).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    (rm, rv), (rm64, rv64) = _module_pair(C)
    before = rm.clone(), rv.clone()
    y = bn.batch_norm(x, rm, rv, weight, bias, training=False)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    ref = F.batch_norm(x64, rm64, rv64, w64, b64, training=False)
    assert_close(y, ref, dtype)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
    assert_backward_matches(y, ref, (x, weight, bias), (x64, w64, b64))


def test_batch_of_one_value_per_channel_refuses_training_like_pytorch():
    x = randn(1, 3, 1, 1)
    rm, rv = randn(3), randn(3).abs()
    before = rm.clone()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        F.batch_norm(x, rm.clone(), rv.clone(), training=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn.batch_norm(x, rm, rv, training=True)
    assert torch.equal(rm, before)
    assert_close(bn.batch_norm(x, rm, rv, training=False), F.batch_norm(x.double(), rm.double(), rv.double()))


@pytest.mark.parametrize("change, error, words", [
    ({"weight": "short"}, ValueError, "weight"),
    ({"bias": "short"}, ValueError, "bias"),
    ({"running_mean": "float64"}, ValueError, "running_mean"),
    ({"running_var": "short"}, ValueError, "running_var"),
    ({"running_var": None}, ValueError, "running_mean, running_var"),
    ({"momentum": None}, TypeError, "num_batches_tracked"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"training": "yes"}, TypeError, "training"),
])
def test_batch_norm_refuses_bad_arguments_and_writes_nothing(change, error, words):
    C = 3
    args = {"running_mean": randn(C), "running_var": randn(C).abs(), "weight": randn(C), "bias": randn(C),
            "training": True, "momentum": 0.1, "eps": 1e-5}
    before = args["running_mean"].clone(), args["running_var"].clone()
    transforms = {"short": lambda t: t[:-1], "float64": lambda t: t.double()}
    for name, how in change.items():
        args[name] = transforms[how](args[name]) if how in transforms else how
    with pytest.raises(error, match=words):
        bn.batch_norm(randn(2, C, 2, 2), **args)
    if change.get("running_var", 0) is not None and "running_mean" not in change:
        assert torch.equal(args["running_mean"], before[0])
    if "running_var" not in change:
        assert torch.equal(args["running_var"], before[1])


def test_batch_norm_eval_needs_running_stats():
    with pytest.raises(ValueError, match="running_mean"):
        bn.batch_norm(randn(2, 3, 2, 2), None, None, training=False)


def test_batch_norm_custom_ops_pass_opcheck():
    C = 3
    x = randn(2, C, 3, 2).requires_grad_()
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    stats = randn(C), randn(C).abs() + 0.5
    torch.library.opcheck(bn.batch_norm_train_op, (x, weight, bias, 1e-5))
    torch.library.opcheck(bn.batch_norm_eval_op, (x, *stats, weight, bias, 1e-5))
    dy = randn(2, C, 3, 2)
    torch.library.opcheck(bn.batch_norm_train_backward_op, (dy, x.detach(), weight.detach(), *stats))
    torch.library.opcheck(bn.batch_norm_eval_backward_op, (dy, x.detach(), *stats, None, 1e-5))
    torch.library.opcheck(bn.batch_norm_train_update_op, (x.detach(), weight.detach(), bias.detach(),
                                                         randn(C), randn(C).abs() + 0.5, 0.1, 1e-5))


@gpu
@pytest.mark.parametrize("spatial", [12, 64], ids=["fused", "split"])  # channels in one tile, or split passes
def test_compiled_fullgraph_matches_eager_on_gpu(spatial):
    """BN (training, running stats updated in place) then pooling, through torch.compile(fullgraph=True)."""
    C = 8
    weight, bias = randn(C).requires_grad_(), randn(C).requires_grad_()
    stats = {"eager": (torch.zeros(C, device=DEVICE), torch.ones(C, device=DEVICE)),
             "compiled": (torch.zeros(C, device=DEVICE), torch.ones(C, device=DEVICE))}
    x = randn(16, C, spatial, spatial).requires_grad_()

    def step(x, running):
        return pool.avg_pool2d(bn.batch_norm(x, *running, weight, bias, training=True), 3, 2, 1, ceil_mode=True)

    compiled_step = torch.compile(step, fullgraph=True)
    for x in (x, x[:5]):  # a second batch size: the recompile traces symbolic sizes
        grads = {}
        for name, fn in (("eager", step), ("compiled", compiled_step)):
            y = fn(x, stats[name])
            grads[name] = (y, *torch.autograd.grad(y.square().sum(), (x, weight, bias)))
        for a, b in zip(grads["eager"], grads["compiled"]):
            torch.testing.assert_close(b, a)
        for a, b in zip(stats["eager"], stats["compiled"]):
            torch.testing.assert_close(a, b)


def test_the_running_statistics_operator_refuses_a_call_that_needs_its_gradient():
    """nnkernels::batch_norm_train_update mutates, so torch.library takes no autograd formula for it: called where
    a gradient would be needed it raises, rather than return outputs with no gradient (nnkernels.batch_norm
    differentiates it through its own wrapper)."""
    x = randn(2, 3, 4, 4).requires_grad_()
    mean, var = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    with pytest.raises(RuntimeError, match="batch_norm_train_update, which has no autograd formula"):
        torch.ops.nnkernels.batch_norm_train_update(x, None, None, mean, var, 0.1, 1e-5)
    assert torch.equal(mean, torch.zeros(3, device=DEVICE))  # nothing updated
    with torch.no_grad():
        y, _, _ = torch.ops.nnkernels.batch_norm_train_update(x, None, None, mean, var, 0.1, 1e-5)
    assert_close(y, F.batch_norm(x.detach().double(), None, None, training=True), torch.float32)
