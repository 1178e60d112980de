"""`side_by_side`: the convolution backward's dw on a side stream beside dx while a CUDA graph is captured, one
after the other otherwise; the fork keeps one stream's ordering and the results (bitwise, against the two run
one after the other)."""

import pytest
import torch
from support import DEVICE, assert_close, gpu, randn
from nnkernels.functional import streams
from nnkernels.functional.streams import forked, side_by_side
from nnkernels.functional import conv as conv_module


def test_side_by_side_returns_both_results():
    x = randn(64)
    main_result, (side_result,) = side_by_side(x.device, lambda: x * 2, lambda: (x + 1,))
    assert torch.equal(main_result, x * 2) and torch.equal(side_result, x + 1)


@gpu
def test_side_by_side_forks_only_while_a_graph_is_captured(monkeypatch):
    calls = []
    monkeypatch.setattr(streams, "forked", lambda device, main_work, side_work: calls.append(device) or
                        (main_work(), side_work()))
    x = randn(64)
    side_by_side(x.device, lambda: x * 2, lambda: (x + 1,))
    assert calls == []
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        side_by_side(x.device, lambda: x * 2, lambda: (x + 1,))
    assert calls == [x.device]


@gpu
def test_side_work_waits_for_earlier_work_and_later_work_waits_for_it():
    """The current stream is held up by a sleep before it fills x: side work that did not wait for it would
    read the old x, and work queued after the join that did not wait for the side stream its old output."""
    x = torch.zeros(1 << 20, device=DEVICE)
    out = torch.zeros_like(x)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
    x.fill_(1.0)

    def side_work():
        torch.cuda._sleep(200_000_000)  # the side stream now finishes last
        out.copy_(x + 1)
        return (out,)

    main_result, _ = forked(x.device, lambda: x * 2, side_work)
    after = out * 3
    assert bool((main_result == 2).all()) and bool((after == 6).all())


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, weight_shape, padding", [((4, 32, 14, 14), (64, 32, 1, 1), 0),
                                                          ((4, 32, 14, 14), (32, 32, 3, 3), 1)],
                         ids=["pointwise", "3x3"])
def test_backward_beside_equals_one_after_the_other(dtype, shape, weight_shape, padding):
    """Captured in a CUDA graph, the backward forks (dw beside dx); eager, it runs them in turn: same bits."""
    x, w, b = randn(*shape, dtype=dtype), randn(*weight_shape, dtype=dtype), randn(weight_shape[0], dtype=dtype)
    y = conv_module.conv2d(x, w, b, padding=padding)
    dy = randn(*y.shape, dtype=dtype)
    args = (dy, x, w, [1, 1], [padding, padding], [1, 1], 1, True, True, True)
    in_turn = torch.ops.nnkernels.conv2d_backward(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        beside = torch.ops.nnkernels.conv2d_backward(*args)
    graph.replay()
    for got, want in zip(beside, in_turn):
        assert torch.equal(got, want)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.conv2d(x64, w64, b64, padding=padding).backward(dy.double())
    for got, want in zip(beside, (x64.grad, w64.grad, b64.grad)):
        assert_close(got, want, tol=2e-3 if dtype == torch.float32 else None)
