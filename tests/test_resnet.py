"""torchvision's ResNet-18 and ResNet-50, converted to nnkernels layers, against the unconverted
model: forward outputs and parameter gradients in train and eval mode, running statistics after
three training steps, in fp32 (TF32 off) and under bf16 autocast; and torch.compile(fullgraph=True).
GPU only (torchvision is not installable beside the CPU torch of the test machine)."""
import copy

import pytest
import torch

from support import assert_close, gpu

from nnkernels.nn import BatchNorm2d, convert

torchvision = pytest.importorskip("torchvision") if torch.cuda.is_available() else None
pytestmark = gpu

# Relative error allowed (||ours - torch|| / ||torch||), from the acceptance criteria.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
BATCH, IMAGE_SIZE = 8, 64


@pytest.fixture
def exact_fp32():
    """TF32 off, so fp32 convolutions on both sides are IEEE fp32 and 1e-4 is a fair bound."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def twins(name, seed=0):
    torch.manual_seed(seed)
    reference = getattr(torchvision.models, name)(num_classes=10).cuda()
    ours = convert(copy.deepcopy(reference))
    summary = ours.nnkernels_summary
    assert summary.swapped["Conv2d"] > 0 and summary.swapped["BatchNorm2d"] > 0 and not summary.left, summary
    return ours, reference


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).cuda()
    labels = torch.randint(0, 10, (BATCH,), generator=generator).cuda()
    return images, labels


def forward_backward(model, images, labels, precision):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(images)
        loss = torch.nn.functional.cross_entropy(out, labels)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out


def relative_error(out, ref) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_all_close(named_pairs, tol, what):
    """Every (name, ours, torch) within `tol`; on failure, list every tensor over it, worst first,
    so one GPU run shows where the difference starts."""
    errors = {name: relative_error(out, ref) for name, out, ref in named_pairs}
    assert errors, f"no {what} compared"
    bad = sorted(((err, name) for name, err in errors.items() if not err <= tol), reverse=True)
    listing = ", ".join(f"{name} {err:.2e}" for err, name in bad[:12])
    assert not bad, f"{len(bad)} of {len(errors)} {what} over {tol:.0e}: {listing}"


def assert_same_step(ours, reference, step, precision):
    images, labels = batch(step)
    tol = TOLERANCE[precision]
    out = forward_backward(ours, images, labels, precision)
    ref = forward_backward(reference, images, labels, precision)
    assert out.dtype == ref.dtype, f"output dtype {out.dtype} != torch's {ref.dtype}"
    assert_close(out, ref, tol=tol)
    assert_same_grads(ours, reference, tol)


def assert_same_grads(ours, reference, tol):
    pairs = list(zip(ours.named_parameters(), reference.parameters()))
    assert all(p.grad is not None for (_, p), _ in pairs), "a parameter got no gradient"
    assert_all_close([(name, p.grad, q.grad) for (name, p), q in pairs], tol, "gradients")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_converted_resnet_matches_torch(name, precision, exact_fp32):
    ours, reference = twins(name)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ours, reference)]
    # Train mode: outputs and gradients of the first step, then three steps of training.
    for step in range(3):
        if step == 0:
            assert_same_step(ours, reference, step, precision)
        else:
            for model in (ours, reference):
                forward_backward(model, *batch(step), precision)
        for optimiser in optimisers:
            optimiser.step()
    bns = [(n, m) for n, m in ours.named_modules() if isinstance(m, BatchNorm2d)]
    ref_modules = dict(reference.named_modules())
    assert bns
    for name_bn, bn in bns:
        assert bn.num_batches_tracked.item() == ref_modules[name_bn].num_batches_tracked.item() == 3
    assert_all_close([(f"{n}.{stat}", getattr(bn, stat), getattr(ref_modules[n], stat))
                      for n, bn in bns for stat in ("running_mean", "running_var")],
                     TOLERANCE[precision], "running statistics")
    # Eval mode, on the running statistics the three steps left.
    ours.eval()
    reference.eval()
    assert_same_step(ours, reference, 3, precision)


def test_torch_compile_fullgraph_matches_eager(exact_fp32):
    ours, reference = twins("resnet18")
    compiled = torch.compile(ours, fullgraph=True)
    images, labels = batch(0)
    out = forward_backward(compiled, images, labels, "fp32")
    ref = forward_backward(reference, images, labels, "fp32")
    assert_close(out, ref, tol=TOLERANCE["fp32"])
    assert_same_grads(ours, reference, TOLERANCE["fp32"])
    assert_all_close([(name, b.float(), c.float()) for (name, b), c in zip(ours.named_buffers(), reference.buffers())],
                     TOLERANCE["fp32"], "buffers")
