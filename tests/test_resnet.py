"""torchvision's ResNet-18 and ResNet-50, converted to nnkernels layers, against the unconverted
model: forward outputs and parameter gradients in train and eval mode, running statistics after
three training steps, in fp32 (TF32 off) and under bf16 autocast; and torch.compile(fullgraph=True).
GPU only (torchvision is not installable beside the CPU torch of the test machine).

A third copy of the model runs in float64 and arbitrates: a tensor passes when ours is within
the issue's bound of torch's (1e-4 fp32, 2e-2 bf16), or when ours is at least as close to the
float64 result as torch's own is, within a factor of two. Deep in the backward pass two correct
fp32 implementations can differ by more than 1e-4 (batch norm's backward cancels most of its
input at every layer), and then the float64 result tells which one is off. Every comparison
prints its three errors, so the log shows how close ours is even where the bound holds.

The ReLUs take the float64 model's masks in all three models (`PinnedReLUs`). ReLU's gradient
jumps at 0, so a pre-activation within rounding of 0 sends a whole element's gradient one way
or the other depending on the last bit of an fp32 sum. Measured: in ResNet-18 at 64 px one
pre-activation of layer3.1 is 2.9e-7 in float64; the fp32 run that rounds it across 0 (torch's
on the CPU; on the H200 ours, with the same 1.4e-2 in the same channel) has that channel's bias
gradient 1.4e-2 off and every gradient below it 1e-2 off, while each module alone, on the other
model's recorded inputs, is within 1e-6 (tools/resnet_gradient_trace.py). Pinning the masks
compares the kernels, not the coin toss.
"""
import copy

import pytest
import torch

from support import gpu

from nnkernels.nn import BatchNorm2d, convert

torchvision = pytest.importorskip("torchvision") if torch.cuda.is_available() else None
pytestmark = gpu

# Relative error allowed (||ours - torch|| / ||torch||), from the acceptance criteria.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
BATCH, IMAGE_SIZE = 8, 64
# SGD's learning rate for the three training steps. At 0.01 a randomly initialised ResNet-50 drifts
# apart from its own float64 copy (torch's fp32, on the H200: running statistics 5e-2 after three
# steps, eval-mode gradients 0.87), so every comparison after the first step measured that drift.
LR = 1e-3


class PinnedReLUs:
    """Makes every ReLU of the models take the masks the float64 model's ReLUs computed, call by
    call: run the float64 model first (`record`), then each of the others (`replay`)."""

    def __init__(self, models):
        self.masks, self.next = {}, {}
        self.recording = models[-1]
        for model in models:
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.ReLU):
                    module.forward = self._forward(model, name)

    def _forward(self, model, name):
        def forward(x):
            if model is self.recording:
                mask = x > 0
                self.masks.setdefault(name, []).append(mask)
            else:
                index = self.next.get((id(model), name), 0)
                self.next[(id(model), name)] = index + 1
                mask = self.masks[name][index]
            return x * mask.to(x.dtype)
        return forward

    def new_step(self):
        self.masks.clear()
        self.next.clear()


def triplets(name, seed=0):
    """(ours, torch's, torch's in float64): three copies of one randomly initialised model, with the
    ReLUs of all three pinned to the float64 model's masks (see the module docstring)."""
    torch.manual_seed(seed)
    reference = getattr(torchvision.models, name)(num_classes=10).cuda()
    ours = convert(copy.deepcopy(reference))
    summary = ours.nnkernels_summary
    assert summary.swapped["Conv2d"] > 0 and summary.swapped["BatchNorm2d"] > 0 and not summary.left, summary
    models = (ours, reference, copy.deepcopy(reference).double())
    return models, PinnedReLUs(models)


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).cuda()
    labels = torch.randint(0, 10, (BATCH,), generator=generator).cuda()
    return images, labels


def forward_backward(model, images, labels, precision):
    """One forward and backward; `precision` "bf16" autocasts, "fp64" runs the float64 copy."""
    if precision == "fp64":
        images = images.double()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(images)
        loss = torch.nn.functional.cross_entropy(out, labels)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out


def relative_error(out, ref) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_all_close(what, ours, theirs, exact, tol):
    """ours, theirs, exact: lists of (name, tensor) in the same order. See the module docstring."""
    assert len(ours) == len(theirs) == len(exact) > 0, f"no {what} compared"
    rows = [(name, relative_error(o, t), relative_error(o, e), relative_error(t, e))
            for (name, o), (_, t), (_, e) in zip(ours, theirs, exact)]
    print(f"{what}: max over {len(rows)} of ||ours - torch||/||torch|| {max(r[1] for r in rows):.2e}, "
          f"ours vs float64 {max(r[2] for r in rows):.2e}, torch vs float64 {max(r[3] for r in rows):.2e}")
    bad = sorted(((vs_torch, name, vs_exact, torch_vs_exact) for name, vs_torch, vs_exact, torch_vs_exact in rows
                  if not (vs_torch <= tol or vs_exact <= 2 * torch_vs_exact)), reverse=True)
    listing = ", ".join(f"{name} (vs torch {a:.1e}, ours/torch vs float64 {b:.1e}/{c:.1e})"
                        for a, name, b, c in bad[:10])
    assert not bad, f"{len(bad)} of {len(rows)} {what} over {tol:.0e}, less accurate than torch's: {listing}"


def step_all(models, relus, step, precision):
    """One forward and backward of the three models on batch `step`, the float64 one first (it sets
    the ReLU masks); their outputs in the models' order."""
    images, labels = batch(step)
    relus.new_step()
    exact = forward_backward(models[2], images, labels, "fp64")
    return [forward_backward(models[0], images, labels, precision),
            forward_backward(models[1], images, labels, precision), exact]


def assert_same_step(models, relus, step, precision):
    """Outputs and parameter gradients of one forward and backward of the three models."""
    outputs = step_all(models, relus, step, precision)
    assert outputs[0].dtype == outputs[1].dtype, f"output dtype {outputs[0].dtype} != torch's {outputs[1].dtype}"
    assert_all_close("outputs", *[[("logits", out)] for out in outputs], TOLERANCE[precision])
    for model in models:
        assert all(p.grad is not None for p in model.parameters()), "a parameter got no gradient"
    assert_all_close("gradients", *[[(n, p.grad) for n, p in m.named_parameters()] for m in models],
                     TOLERANCE[precision])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_converted_resnet_matches_torch(name, precision, exact_fp32):
    models, relus = triplets(name)
    optimisers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    # Train mode: outputs and gradients of the first step, then three steps of training.
    for step in range(3):
        if step == 0:
            assert_same_step(models, relus, step, precision)
        else:
            step_all(models, relus, step, precision)
        for optimiser in optimisers:
            optimiser.step()
    ours = models[0]
    bn_names = [n for n, m in ours.named_modules() if isinstance(m, BatchNorm2d)]
    assert bn_names
    layers = [dict(m.named_modules()) for m in models]
    for bn_name in bn_names:
        assert [int(layer[bn_name].num_batches_tracked) for layer in layers] == [3, 3, 3], bn_name
    assert_all_close("running statistics", *[[(f"{n}.{stat}", getattr(layer[n], stat)) for n in bn_names
                                              for stat in ("running_mean", "running_var")] for layer in layers],
                     TOLERANCE[precision])
    # Eval mode, all three on the float64 model's parameters and running statistics (load_state_dict
    # casts them): three steps leave the three models' weights apart by more than rounding, and eval
    # mode on their own weights would compare that drift, not the eval kernels.
    state = models[2].state_dict()
    for model in models:
        model.load_state_dict(state)
        model.eval()
    assert_same_step(models, relus, 3, precision)


def test_torch_compile_fullgraph_matches_eager(exact_fp32):
    """The compiled converted model against the same model run eagerly: outputs, parameter gradients
    and running statistics (torchvision's own ReLUs here: compiled and eager compute the same
    pre-activations, so their masks agree)."""
    torch.manual_seed(0)
    eager = convert(torchvision.models.resnet18(num_classes=10).cuda())
    compiled_copy = copy.deepcopy(eager)
    compiled = torch.compile(compiled_copy, fullgraph=True)
    images, labels = batch(0)
    outputs = [forward_backward(compiled, images, labels, "fp32"), forward_backward(eager, images, labels, "fp32")]
    assert_all_close("outputs", [("logits", outputs[0])], [("logits", outputs[1])], [("logits", outputs[1])],
                     TOLERANCE["fp32"])
    gradients = [[(n, p.grad) for n, p in m.named_parameters()] for m in (compiled_copy, eager)]
    assert_all_close("gradients", gradients[0], gradients[1], gradients[1], TOLERANCE["fp32"])
    buffers = [[(n, b.double()) for n, b in m.named_buffers()] for m in (compiled_copy, eager)]
    assert_all_close("buffers", buffers[0], buffers[1], buffers[1], TOLERANCE["fp32"])
