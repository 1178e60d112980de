"""The kernel-object API: ids, hashes, sources, signature, compile, catalogue, and bad input."""
import re

import pytest
import torch
from support import DEVICE, gpu, poisoned, randn

import nnkernels as nk
from nnkernels.kernel import compile_all

SEEDS = {
    "Conv2dForward",
    "Conv2dBackward",
    "Avgpool2dForward",
    "Avgpool2dBackward",
    "BatchNorm2dNchwForwardInference",
    "BatchNorm2dNchwBackward",
}


def test_id_name_and_constants_follow_the_seed():
    k = nk.Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 64)
    assert k.name == "conv2d_backward"
    assert k.id == "conv2d_backward__fp32__3__3__1__1__1__1__1__64"
    assert (k.kh, k.kw, k.stride_h, k.stride_w, k.pad_h, k.pad_w, k.g, k.block_ow) == (3, 3, 1, 1, 1, 1, 1, 64)
    assert k.entry_point_name == "conv2d_backward_entry_point"
    bf16 = nk.Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 64, dtype=torch.bfloat16)
    assert bf16.id == "conv2d_backward__bf16__3__3__1__1__1__1__1__64"
    assert nk.Avgpool2dBackward(kh=2, kw=2, stride_h=2, stride_w=2, block_ow=32).id == (
        "avgpool2d_backward__fp32__2__2__2__2__32"
    )
    assert nk.BatchNorm2dNchwBackward(256, dtype=torch.float16).block_hw == 256


def test_hash_is_a_content_key():
    base = nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 64)
    assert base.hash == nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 64).hash
    assert re.fullmatch(r"[0-9a-f]{64}", base.hash)
    others = [
        nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 32),
        nk.Conv2dForward(3, 3, 2, 1, 1, 1, 1, 64),
        nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 64, dtype=torch.bfloat16),
        nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 64, num_warps=8),
        nk.Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 64),
    ]
    assert len({base.hash, *(o.hash for o in others)}) == 1 + len(others)


def test_sources():
    k = nk.BatchNorm2dNchwBackward(128)
    assert k.kernel_source.startswith("def batch_norm2d_nchw_backward(")
    assert "BLOCK_HW: tl.constexpr" in k.kernel_source
    assert "def batch_norm_backward_entry(" in k.entry_point_source  # checks and grid
    assert "def launch(self, *args):" in k.entry_point_source  # the generic launcher that runs it
    assert k.source == k.kernel_source + "\n\n" + k.entry_point_source


def test_sources_hold_every_jit_helper_a_kernel_calls():
    """A kernel's source (and so its hash) includes each @triton.jit function it calls, and theirs in
    turn: a helper changed must change the hash of every kernel that runs it."""
    import sys

    from triton.runtime.jit import KernelInterface  # compiled and interpreted @triton.jit functions alike

    for cls in nk.catalogue():
        module = sys.modules[cls._runner.fn.__module__]
        helpers = {name for name, value in vars(module).items() if isinstance(value, KernelInterface)}
        called = {name for name in helpers if re.search(rf"\b{name}\(", cls._kernel_source)}
        missing = {name for name in called if f"def {name}(" not in cls._kernel_source}
        assert not missing, f"{cls.__name__}: helpers called but not in its source: {sorted(missing)}"

def test_signature_is_ordered_and_typed():
    assert list(nk.Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 64, dtype=torch.float16).signature.items()) == [
        ("dy", "*fp16"), ("x", "*fp16"), ("w", "*fp16"), ("dx", "*fp16"), ("dw", "*fp16"),
        ("B", "i32"), ("C_IN", "i32"), ("C_OUT", "i32"), ("H", "i32"), ("W", "i32"), ("OH", "i32"), ("OW", "i32"),
    ]  # fmt: skip
    bn = nk.BatchNorm2dNchwForwardInference(64, dtype=torch.bfloat16).signature
    assert list(bn) == ["x", "y", "weight", "bias", "running_mean", "running_var", "C", "HW", "eps"]
    assert (bn["x"], bn["C"], bn["eps"]) == ("*bf16", "i32", "fp32")


def test_catalogue_lists_every_seed_kernel():
    names = {cls.__name__ for cls in nk.catalogue()}
    assert SEEDS <= names
    assert all(issubclass(cls, nk.KernelObject) for cls in nk.catalogue())
    assert {cls.__name__ for cls in nk.catalogue() if cls.seed} == SEEDS


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_compile_ahead_of_time_needs_no_gpu(target):
    kernels = [cls.example(torch.bfloat16) for cls in nk.catalogue() if cls.seed]
    for kernel, built in zip(kernels, compile_all(kernels, target)):
        assert built.name == kernel.entry_point_name
        assert f".entry {kernel.entry_point_name}(" in built.ptx
        assert f".target sm_{target[3:]}" in built.ptx
        assert isinstance(built.cubin, bytes) and built.cubin[:4] == b"\x7fELF"
        assert built.target == target and built.num_warps == kernel.num_warps
        assert kernel.compile(target) is built  # remembered


@pytest.mark.parametrize("target", ["sm_12", "gfx90a", "sm_90x", "90", ""])
def test_unknown_compile_target_is_a_clear_error(target):
    with pytest.raises(ValueError, match="target: expected one of .*sm_90"):
        nk.Avgpool2dForward(2, 2, 2, 2, 32).compile(target)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: nk.Conv2dForward(0, 3, 1, 1, 1, 1, 1, 64), ValueError, "kh: expected an int >= 1, got 0"),
        (lambda: nk.Conv2dForward(3, 3, 1, 1, -1, 1, 1, 64), ValueError, "pad_h: expected an int >= 0"),
        (lambda: nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1, 48), ValueError, "block_ow: expected a power of two"),
        (lambda: nk.Conv2dForward(3, 3, 1, 1, 1, 1, 1), TypeError, "missing constant.*block_ow"),
        (lambda: nk.Avgpool2dForward(2, 2, 2, 2, 32, 1), TypeError, "takes 5 constants"),
        (lambda: nk.Avgpool2dForward(2, 2, 2, 2, block=32), TypeError, "unknown constant 'block'"),
        (lambda: nk.Avgpool2dForward(2.0, 2, 2, 2, 32), TypeError, "kh: expected an int"),
        (lambda: nk.BatchNorm2dNchwBackward(64, dtype=torch.float64), TypeError, "dtype: expected one of"),
        (lambda: nk.BatchNorm2dNchwBackward(64, num_warps=0), ValueError, "num_warps: expected a positive int"),
    ],
)
def test_bad_constants(make, error, match):
    with pytest.raises(error, match=match):
        make()


def conv_forward_args(**change):
    """A valid Conv2dForward launch (2x4x5x6 input, 3x3, pad 1, g 2) with `change` applied."""
    args = dict(
        x=randn(2, 4, 5, 6), w=randn(6, 2, 3, 3), y=poisoned(2, 6, 5, 6), B=2, C_IN=4, C_OUT=6, H=5, W=6, OH=5, OW=6
    )
    args.update(change)
    return args


CONV_BAD_INPUTS = [
    ("too few arguments", "drop", TypeError, r"takes 10 arguments \(x, w, y, B, C_IN, C_OUT, H, W, OH, OW\), got 9"),
    ("wrong dtype", dict(w=randn(6, 2, 3, 3, dtype=torch.float16)), TypeError, "w: expected dtype torch.float32"),
    ("int tensor", dict(x=torch.ones(2, 4, 5, 6, dtype=torch.int32, device=DEVICE)), TypeError, "x: expected dtype"),
    ("not a tensor", dict(w=[1.0] * 108), TypeError, "w: expected a torch.Tensor"),
    ("other device", dict(w=torch.randn(6, 2, 3, 3, device="meta")), ValueError, "w: expected a tensor on"),
    ("non-contiguous", dict(x=randn(2, 4, 6, 5).transpose(2, 3)), ValueError, "x: expected a contiguous tensor"),
    ("C_IN % g", dict(C_IN=3, x=randn(2, 3, 5, 6)), ValueError, "C_IN: expected a multiple of g = 2, got 3"),
    ("OH inconsistent", dict(OH=4), ValueError, r"OH: expected \(H \+ 2\*pad_h - kh\) // stride_h \+ 1 = 5, got 4"),
    ("OH for H=1", dict(H=1, x=randn(2, 4, 1, 6)), ValueError, r"OH: expected .* = 1, got 5"),
    ("x too small", dict(x=randn(2, 4, 5, 5)), ValueError, r"x: expected B\*C_IN\*H\*W = 240 elements, got 200"),
    ("y too small", dict(y=poisoned(2, 6, 5, 5)), ValueError, r"y: expected B\*C_OUT\*OH\*OW = 360 elements"),
    ("zero batch", dict(B=0), ValueError, r"B: expected an int in \[1, 2\*\*31 - 1\], got 0"),
    ("negative size", dict(W=-6), ValueError, "W: expected an int in"),
    ("float size", dict(H=5.0), TypeError, "H: expected an int, got float"),
    ("bool size", dict(B=True), TypeError, "B: expected an int, got bool"),
]


@pytest.mark.parametrize("change,error,match", [c[1:] for c in CONV_BAD_INPUTS], ids=[c[0] for c in CONV_BAD_INPUTS])
def test_bad_launch_arguments_write_nothing(change, error, match):
    args = conv_forward_args(**({} if change == "drop" else change))
    values = list(args.values())[:-1] if change == "drop" else list(args.values())
    with pytest.raises(error, match=match):
        nk.Conv2dForward(3, 3, 1, 1, 1, 1, 2, 8).launch(*values)
    assert torch.isnan(args["y"]).all(), "an output was written although the launch was refused"


def test_kernel_larger_than_padded_input():
    y = poisoned(1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"H: padded input size 2 \+ 2\*pad_h = 2 is smaller than kh = 3"):
        nk.Conv2dForward(3, 3, 1, 1, 0, 0, 1, 8).launch(randn(1, 1, 2, 4), randn(1, 1, 3, 3), y, 1, 1, 1, 2, 4, 1, 2)
    assert torch.isnan(y).all()


def test_bad_batch_norm_arguments_write_nothing():
    x, dy = randn(2, 3, 4, 4), randn(2, 3, 4, 4)
    dx, dweight, dbias = poisoned(2, 3, 4, 4), poisoned(3), poisoned(3)
    stats = [randn(3), randn(3), randn(3).abs()]
    kernel = nk.BatchNorm2dNchwBackward(16)
    with pytest.raises(ValueError, match="running_mean: expected C = 3 elements, got 4"):
        kernel.launch(dy, x, dx, stats[0], randn(4), stats[2], dweight, dbias, 2, 3, 16, 1e-5)
    with pytest.raises(ValueError, match="eps: expected a float >= 0, got -1.0"):
        kernel.launch(dy, x, dx, *stats, dweight, dbias, 2, 3, 16, -1.0)
    with pytest.raises(TypeError, match="eps: expected a float, got str"):
        kernel.launch(dy, x, dx, *stats, dweight, dbias, 2, 3, 16, "1e-5")
    for out in (dx, dweight, dbias):
        assert torch.isnan(out).all()


@gpu
def test_cpu_tensors_in_a_compiled_process_are_refused():
    y = torch.full((1, 1, 1, 1), float("nan"))
    with pytest.raises(ValueError, match="CPU tensors need Triton's interpreter"):
        nk.Avgpool2dForward(2, 2, 2, 2, 32).launch(torch.randn(1, 1, 2, 2), y, 1, 1, 2, 2, 1, 1)
    assert torch.isnan(y).all()


def test_a_launch_switches_device_only_to_leave_the_current_one(monkeypatch):
    """Triton launches on the current GPU: a launch on another one switches to it (`torch.cuda.device`, 4.8 µs
    on the H200 machine), a launch on the current one or on CPU tensors does not."""
    import contextlib

    from nnkernels.kernel import _on_device

    switched = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or contextlib.nullcontext())
    for device in (torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)):
        with _on_device(device):
            pass
    assert switched == [torch.device("cuda", 1)]


def test_each_launch_runs_the_kernel_compiled_for_its_arguments():
    """After a compiled kernel's first launch, later ones skip Triton's search for it, keyed on what Triton
    specialises on: each pointer's 16-byte alignment and each size's divisibility by 16 or being 1. Launches
    that change one of those in turn (and go back) must each get the right kernel, so the right result."""
    from nnkernels.ops.common.layout import ChannelsLastCopy

    kernel = ChannelsLastCopy(16, 16, 1, 1)
    source = randn(2 * 33 * 32 + 1)
    for offset, b, c, hw in [(0, 2, 32, 16), (1, 2, 32, 16), (0, 2, 33, 16), (0, 1, 32, 16), (0, 2, 32, 1),
                             (1, 2, 33, 1), (0, 2, 32, 16)]:
        x = source[offset:offset + b * c * hw].view(b, c, hw)
        y = poisoned(b * hw * c + 1)[offset:offset + b * hw * c]  # the output's alignment follows the input's
        kernel.launch(x, y, b, c, hw)
        assert torch.equal(y.view(b, hw, c), x.permute(0, 2, 1)), (offset, b, c, hw)


def test_an_int_given_for_a_float_argument_is_a_float():
    """Triton compiles for an argument's Python type, so an int eps would compile a kernel with eps baked in
    as an int (1 even as a constant); the launch passes fp32 arguments as floats, whatever the caller gave."""
    kernel = nk.BatchNorm2dNchwForwardInference(16)
    x, weight, bias, mean = randn(2, 3, 4, 4), randn(3), randn(3), randn(3)
    var = randn(3).abs() + 0.5
    for eps in (1, 0.25, 2, 1.0):
        y = poisoned(2, 3, 4, 4)
        kernel.launch(x, y, weight, bias, mean, var, 3, 16, eps)
        expected = (x - mean[:, None, None]) / (var[:, None, None] + eps).sqrt() * weight[:, None, None]
        torch.testing.assert_close(y, expected + bias[:, None, None], rtol=1e-5, atol=1e-5)
