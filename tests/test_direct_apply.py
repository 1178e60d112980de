"""`functional.common.direct_apply`: an autograd Function's apply without torch's Python wrapper computes and
differentiates as `Function.apply` does, under a functorch transform and on a tensor escaped from one."""
import pytest
import torch

from nnkernels.functional.common import direct_apply


class _Double(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, scale):
        return x * (2 * scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, dy):
        return dy * (2 * ctx.scale), None


def test_results_and_gradients_are_function_apply_s():
    apply = direct_apply(_Double)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y, reference = apply(x, 1.5), _Double.apply(x, 1.5)
    assert type(y.grad_fn) is type(reference.grad_fn)
    assert torch.equal(y, reference)
    dy = torch.randn(3, 4, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy * 3)


def test_a_tensor_escaped_from_vmap_raises_as_with_function_apply():
    escaped = []
    torch.func.vmap(lambda row: escaped.append(row) or row)(torch.randn(2, 3))
    for apply in (_Double.apply, direct_apply(_Double)):
        with pytest.raises(RuntimeError, match="escaped from inside a function being vmapped"):
            apply(escaped[0], 1.0)


def test_under_a_functorch_transform_the_call_takes_torchs_wrapper():
    apply = direct_apply(_Double)
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(torch.func.grad(lambda t: apply(t, 0.5).sum())(x), torch.ones(5, dtype=torch.float64))
    assert torch.equal(torch.func.vmap(lambda t: apply(t, 1.0))(x.view(5, 1)), x.view(5, 1) * 2)
