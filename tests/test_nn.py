"""nnkernels.nn layers against their torch.nn namesakes: constructor, parameters, buffers,
state_dict, repr, unsupported options, bad input, train/eval semantics, and a small CNN that
trains for a few steps with the same losses as its torch twin."""
import copy

import pytest
import torch

from support import DEVICE, assert_close, gpu

import nnkernels.nn as nnk

CONV_CONFIGS = [
    dict(in_channels=3, out_channels=4, kernel_size=3),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 1), stride=2, padding=(1, 0), bias=False),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding="same", dilation=2, groups=2),
    dict(in_channels=2, out_channels=2, kernel_size=1, padding="valid"),
]
POOL_CONFIGS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=(2, 3), stride=1, divisor_override=5),
]
BN_CONFIGS = [
    dict(num_features=4),
    dict(num_features=4, eps=1e-3, momentum=None),
    dict(num_features=4, affine=False),
    dict(num_features=4, track_running_stats=False),
]
LAYERS = ([("Conv2d", c) for c in CONV_CONFIGS] + [("AvgPool2d", c) for c in POOL_CONFIGS]
          + [("BatchNorm2d", c) for c in BN_CONFIGS])


pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/conftest.py: TF32 off


def twin_layers(kind, config):
    torch.manual_seed(0)
    reference = getattr(torch.nn, kind)(**config)
    torch.manual_seed(0)
    ours = getattr(nnk, kind)(**config)
    return ours, reference


@pytest.mark.parametrize("kind, config", LAYERS)
def test_layer_has_torch_parameters_buffers_state_dict_and_repr(kind, config):
    ours, reference = twin_layers(kind, config)
    assert isinstance(ours, getattr(torch.nn, kind))
    assert repr(ours) == f"nnkernels.{reference!r}"  # printed as nnkernels' layer
    ours_state, ref_state = ours.state_dict(), reference.state_dict()
    assert list(ours_state) == list(ref_state)
    for key in ref_state:
        assert torch.equal(ours_state[key], ref_state[key]), key
    # A checkpoint of either loads into the other, strictly.
    ours.load_state_dict(ref_state)
    reference.load_state_dict(ours_state)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_unsupported_options_raise_not_implemented_naming_them():
    with pytest.raises(NotImplementedError, match="padding='same'.*asymmetric"):
        nnk.Conv2d(2, 2, 2, padding="same")


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_padding_modes_pad_as_torch_then_convolve(mode):
    """padding_mode other than 'zeros': torch's F.pad, then nnkernels' convolution without padding; 'same' with
    an even kernel too (the padding is asymmetric, which F.pad takes). Output and gradients against float64."""
    for kernel, padding in ((3, (1, 2)), (2, "same")):
        torch.manual_seed(0)
        reference = torch.nn.Conv2d(3, 4, kernel, padding=padding, padding_mode=mode).to(DEVICE)
        ours = nnk.convert(copy.deepcopy(reference))
        assert type(ours) is nnk.Conv2d
        x = torch.randn(2, 3, 7, 6, device=DEVICE, requires_grad=True)
        with torch.backends.cudnn.flags(allow_tf32=False):
            y = ours(x)
            dy = torch.randn_like(y)
            grads = torch.autograd.grad(y, (x, ours.weight, ours.bias), dy)
        reference64 = copy.deepcopy(reference).cpu().double()
        x64 = x.detach().cpu().double().requires_grad_()
        y64 = reference64(x64)
        grads64 = torch.autograd.grad(y64, (x64, reference64.weight, reference64.bias), dy.cpu().double())
        for out, ref in zip((y, *grads), (y64, *grads64)):
            assert out.shape == ref.shape
            assert_close(out, ref, torch.float32)


def test_bad_input_raises_what_torch_raises_saying_what_was_expected():
    conv, pool, bn = nnk.Conv2d(3, 4, 3).to(DEVICE), nnk.AvgPool2d(2), nnk.BatchNorm2d(3).to(DEVICE)
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"3-D \(C, H, W\) or 4-D \(N, C, H, W\).*\[2, 3, 6, 6, 1\]"):
        conv(x.unsqueeze(-1))
    with pytest.raises(RuntimeError, match="4-D"):
        pool(x[0, 0])
    with pytest.raises(ValueError, match="expected 4D input"):
        bn(x[0])
    with pytest.raises(RuntimeError, match="expected 3 channels"):
        conv(torch.randn(2, 5, 6, 6, device=DEVICE))
    with pytest.raises(RuntimeError, match="expected 3 channels"):
        bn(torch.randn(2, 5, 6, 6, device=DEVICE))
    with pytest.raises(RuntimeError, match="expected dtype torch.float32 like weight, got torch.float16"):
        conv(x.half())
    for layer in (conv, pool, bn):
        with pytest.raises(RuntimeError, match="dtype torch.float64 is not supported; expected torch.float32"):
            layer(x.double())
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            layer(x.cpu().numpy())
    for layer in (conv, bn):
        with pytest.raises(RuntimeError, match=f"expected a tensor on {x.device} like weight, got one on meta"):
            layer(torch.empty(2, 3, 6, 6, device="meta"))


def test_unbatched_input_works_like_torch():
    ours, reference = twin_layers("Conv2d", CONV_CONFIGS[0])
    ours, reference = ours.to(DEVICE), reference.to(DEVICE)
    x = torch.randn(3, 5, 6, device=DEVICE)
    assert_close(ours(x), reference(x))
    pool_ours, pool_ref = twin_layers("AvgPool2d", POOL_CONFIGS[1])
    assert_close(pool_ours(x), pool_ref(x))


@pytest.mark.parametrize("config", BN_CONFIGS)
def test_batch_norm_train_then_eval_updates_and_uses_statistics_like_torch(config):
    ours, reference = (m.to(DEVICE) for m in twin_layers("BatchNorm2d", config))
    for step in range(2):
        x = torch.randn(3, 4, 5, 5, device=DEVICE) * 2 + step
        assert_close(ours(x), reference(x))
    for (name, b), (_, c) in zip(ours.named_buffers(), reference.named_buffers()):
        assert b.dtype == c.dtype, name
        assert_close(b.double(), c.double(), tol=1e-6)
    ours.eval()
    reference.eval()
    x = torch.randn(3, 4, 5, 5, device=DEVICE)
    assert_close(ours(x), reference(x))
    if config.get("track_running_stats", True):
        assert int(ours.num_batches_tracked) == 2


def test_batch_norm_low_precision_input_with_fp32_statistics_returns_input_dtype():
    ours, reference = (m.to(DEVICE) for m in twin_layers("BatchNorm2d", BN_CONFIGS[0]))
    x = torch.randn(3, 4, 5, 5, device=DEVICE).to(torch.bfloat16)
    out = ours(x)
    assert out.dtype == torch.bfloat16 and ours.running_mean.dtype == torch.float32
    assert_close(out, reference(x.float()), dtype=torch.bfloat16)
    assert_close(ours.running_var, reference.running_var, tol=1e-2)


def make_cnn(layers):
    """conv -> BN -> ReLU -> pool, twice (the second pool overlapping, padded), then a linear head."""
    return torch.nn.Sequential(
        layers.Conv2d(2, 4, 3, padding=1),
        layers.BatchNorm2d(4),
        torch.nn.ReLU(),
        layers.AvgPool2d(2),
        layers.Conv2d(4, 6, 3, stride=1, padding=1, groups=2, bias=False),
        layers.BatchNorm2d(6),
        torch.nn.ReLU(),
        layers.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 2 * 2, 3),
    )


def test_small_cnn_trains_with_the_same_losses_as_its_torch_twin():
    torch.manual_seed(0)
    reference = make_cnn(torch.nn).to(DEVICE)
    ours = make_cnn(nnk).to(DEVICE)
    ours.load_state_dict(reference.state_dict())
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, reference)]
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(5, 2, 7, 7, generator=generator).to(DEVICE)
        y = torch.randint(0, 3, (5,), generator=generator).to(DEVICE)
        losses = []
        for model, optimiser in zip((ours, reference), optimisers):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), f"step {step}"
    for (name, p), (_, q) in zip(ours.state_dict().items(), reference.state_dict().items()):
        assert_close(p.double(), q.double(), tol=1e-5)
    ours.eval()
    reference.eval()
    x = torch.randn(5, 2, 7, 7, generator=generator).to(DEVICE)
    assert_close(ours(x), reference(x))


def test_torch_compile_traces_the_layers_in_one_graph():
    """fullgraph=True fails on any graph break in the layers' forward; aot_eager keeps the CPU
    run cheap (tests/test_resnet.py compiles with inductor on the GPU)."""
    torch.manual_seed(0)
    reference = make_cnn(torch.nn).to(DEVICE)
    ours = make_cnn(nnk).to(DEVICE)
    ours.load_state_dict(reference.state_dict())
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 2, 7, 7, device=DEVICE)
    out, ref = compiled(x), reference(x)
    assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    # All gradients as one vector: the first conv's bias feeds a batch norm, so its own gradient is
    # exactly zero in theory and rounding noise in practice, which no relative bound can judge.
    grads = torch.cat([p.grad.flatten() for p in ours.parameters()])
    assert_close(grads, torch.cat([q.grad.flatten() for q in reference.parameters()]), tol=1e-5)
    for b, c in zip(ours.buffers(), reference.buffers()):
        assert_close(b.double(), c.double(), tol=1e-6)


@gpu
def test_autocast_follows_torch_casting_policy():
    """bf16 autocast: conv computes in bf16, batch norm keeps fp32 parameters and returns the
    input's dtype, pooling runs in its input's dtype, as torch's layers do."""
    torch.manual_seed(0)
    reference = make_cnn(torch.nn).cuda()
    ours = make_cnn(nnk).cuda()
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(5, 2, 7, 7, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dtypes = {}
        for model in (ours, reference):
            h, dtypes[model] = x, []
            for layer in model:
                h = layer(h)
                dtypes[model].append(h.dtype)
        assert dtypes[ours] == dtypes[reference]
        assert dtypes[ours][:4] == [torch.bfloat16] * 4
        assert ours[3](x).dtype == torch.float32
        assert_close(ours(x), reference(x), tol=2e-2)
