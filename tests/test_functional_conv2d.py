"""nnkernels.functional.conv: torch's semantics, autograd, custom-op registration, autocast, errors.

References: torch.nn.functional.conv2d and its autograd in float64 on the same data.
On the GPU fp32 is checked with TF32 on (2e-3: TF32 products) and off (1e-5).
"""
import json
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from nnkernels import machine, tuning
from nnkernels.functional.common import KERNELS
from nnkernels.functional.conv import conv2d, kernels_for
from nnkernels.kernel import KernelObject
from support import CONV_TF32_TOLERANCE, DEVICE, INTERPRETED, TOLERANCE, assert_close, gpu, randn


@dataclass(frozen=True)
class Tile:
    """A stand-in for a pass's choice: the tuner knows nothing of what its choices mean."""

    block_m: int
    fails: bool = False


# (B, C_IN, C_OUT, H, W, K, stride, padding, dilation, groups, bias)
CASES = [
    pytest.param((2, 3, 4, 6, 7, 3, 1, 1, 1, 1, True), id="3x3-pad1-bias"),
    pytest.param((2, 4, 4, 7, 6, 3, 2, 1, 1, 4, True), id="depthwise-stride2"),
    pytest.param((1, 4, 6, 9, 8, 3, 2, 2, 2, 2, False), id="groups2-dilated"),
    pytest.param((2, 4, 3, 5, 5, 1, 1, 0, 1, 1, True), id="1x1"),
    pytest.param((2, 16, 32, 5, 6, 3, 1, 1, 1, 1, True), id="channels-last-3x3"),
    pytest.param((1, 32, 16, 7, 6, 3, 2, 1, 1, 1, False), id="channels-last-stride2"),
    pytest.param((1, 16, 16, 6, 7, 3, 1, 3, 1, 1, True), id="channels-last-pad-over-kernel"),
    pytest.param((1, 32, 16, 6, 7, 3, 1, 0, 1, 1, True), id="channels-last-unpadded"),
    pytest.param((2, 16, 32, 9, 8, 3, 1, (2, 1), 2, 1, False), id="channels-last-dilated-uneven-padding"),
    pytest.param((2, 3, 16, 11, 10, 7, 2, 3, 1, 1, True), id="stem-like-dx-channels-last"),
    pytest.param((2, 16, 32, 9, 7, 3, 2, 1, 1, 1, True), id="channels-last-stride2-dx-nhwc"),
    pytest.param((2, 5, 6, 9, 7, 1, 2, 0, 1, 1, True), id="1x1-stride2-subsampled"),
    pytest.param((1, 4, 3, 8, 10, 1, (3, 2), 0, 2, 1, False), id="1x1-stride32-dilated-subsampled"),
]


def _compare(case, dtype, tol):
    B, C_IN, C_OUT, H, W, K, stride, padding, dilation, groups, has_bias = case
    x = randn(B, C_IN, H, W, dtype=dtype).requires_grad_()
    w = randn(C_OUT, C_IN // groups, K, K, dtype=dtype).requires_grad_()
    b = randn(C_OUT, dtype=dtype).requires_grad_() if has_bias else None
    y = conv2d(x, w, b, stride, padding, dilation, groups)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    b64 = b.detach().double().cpu().requires_grad_() if has_bias else None
    y64 = F.conv2d(x64, w64, b64, stride, padding, dilation, groups)
    y64.backward(dy.double().cpu())
    assert y.dtype == dtype
    assert_close(y, y64, tol=tol)
    assert_close(x.grad, x64.grad, tol=tol)
    assert_close(w.grad, w64.grad, tol=tol)
    if has_bias:
        assert_close(b.grad, b64.grad, tol=tol)


@pytest.mark.parametrize("case", CASES)
def test_conv2d_and_autograd_match_torch(case):
    with torch.backends.cudnn.flags(allow_tf32=False):
        _compare(case, torch.float32, TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv2d_16bit(dtype):
    _compare(CASES[0].values[0], dtype, TOLERANCE[dtype])


@gpu
@pytest.mark.parametrize("case", CASES)
def test_conv2d_tf32_follows_cudnn_flag(case):
    with torch.backends.cudnn.flags(allow_tf32=True):
        _compare(case, torch.float32, CONV_TF32_TOLERANCE)


@gpu
def test_backward_bitwise_deterministic_resnet_layer():
    x = randn(8, 64, 28, 28, dtype=torch.bfloat16).requires_grad_()
    w = randn(64, 64, 3, 3, dtype=torch.bfloat16).requires_grad_()
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        conv2d(x, w, None, 1, 1).backward(torch.ones(8, 64, 28, 28, device=DEVICE, dtype=torch.bfloat16))
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@gpu
def test_no_tuning_during_graph_capture(tmp_path, monkeypatch):
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    x, w = randn(3, 24, 11, 11), randn(40, 24, 3, 3)
    monkeypatch.setenv("NNKERNELS_TUNE", "off")
    conv2d(x, w, None, 1, 1)  # compiles the heuristic's kernel outside the capture
    monkeypatch.setenv("NNKERNELS_TUNE", "full")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = conv2d(x, w, None, 1, 1)
    graph.replay()
    assert_close(y, F.conv2d(x.double(), w.double(), None, 1, 1), tol=CONV_TF32_TOLERANCE)
    assert not (tmp_path / "tuning.json").exists()


def test_unbatched_input_and_string_padding():
    x, w = randn(3, 6, 5), randn(4, 3, 2, 2)
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = conv2d(x, w, padding="same")
        assert_close(y, F.conv2d(x.double(), w.double(), padding="same"), torch.float32)
        assert_close(conv2d(x, w, padding="valid"), F.conv2d(x.double(), w.double()), torch.float32)


def test_opcheck():
    x, w, b = randn(2, 3, 5, 5), randn(4, 3, 3, 3), randn(4)
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), [1, 1], [1, 1], [1, 1], 1)
    torch.library.opcheck(torch.ops.nnkernels.conv2d.default, args)


def test_autocast_runs_in_the_active_autocast_dtype():
    x, w = randn(2, 3, 5, 5), randn(4, 3, 3, 3)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = conv2d(x, w, None, 1, 1)
        reference = F.conv2d(x, w, None, 1, 1)
    assert y.dtype == reference.dtype == torch.bfloat16
    assert_close(y, F.conv2d(x.double(), w.double(), None, 1, 1), torch.bfloat16)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (randn(1, 3, 5, 5), randn(4, 2, 3, 3), {}), ValueError, "input: expected 2 channels"),
        (lambda: (randn(1, 4, 5, 5), randn(6, 2, 3, 3), {"groups": 4}), ValueError, "groups"),
        (lambda: (randn(1, 6, 5, 5), randn(4, 2, 3, 3), {"groups": 3}), ValueError, "groups: 3 does not divide"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3), {"padding": -1}), ValueError, "padding"),
        (lambda: (randn(1, 3, 2, 2), randn(4, 3, 3, 3), {}), ValueError, "larger than the padded input"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3, dtype=torch.float16), {}), ValueError, "weight: expected dtype"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3), {"bias": randn(5)}), ValueError, "bias: expected shape"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3), {"stride": 0}), ValueError, "stride"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3), {"stride": (1, 2, 3)}), TypeError, "stride"),
        (lambda: (randn(5, 5), randn(4, 3, 3, 3), {}), ValueError, "input: expected a 3-D"),
        (lambda: (randn(1, 3, 5, 5).double(), randn(4, 3, 3, 3).double(), {}), TypeError, "float32, float16"),
        (lambda: (randn(1, 3, 5, 5), randn(4, 3, 3, 3).to("meta"), {}), ValueError, "weight: expected a tensor on"),
        # 2**28 input elements but 2**32 in one output image: the kernels index inside an image in int32.
        (lambda: (randn(1, 1, 1, 1).expand(1, 1, 16384, 16384), randn(16, 1, 3, 3), {"padding": 1}), ValueError,
         "one output image"),
    ],
)
def test_bad_input_names_the_argument(make, error, match):
    x, w, options = make()
    with pytest.raises(error, match=match):
        conv2d(x, w, **options)


LAYOUT_COPIES = ("channels_last_copy", "subsample2d")


def products(*args, **options):
    """`kernels_for` without the layout copies."""
    return [k for k in kernels_for(*args, **options) if not k.startswith(LAYOUT_COPIES)]


def test_kernels_for_names_the_choice():
    depthwise = kernels_for((2, 8, 6, 6), (8, 1, 3, 3), groups=8)
    assert depthwise[0].startswith("conv2d_depthwise_forward") and depthwise[2].startswith("conv2d_depthwise_dw")
    gemm = kernels_for((2, 24, 6, 6), (16, 24, 3, 3), padding=1, bias=True, dtype=torch.bfloat16)
    # 24 input channels: forward and dw on NCHW; 16 output channels: dx from a channels-last copy of dy.
    assert [k.split("__")[0] for k in gemm] == ["conv2d_gemm_forward", "channels_last_copy", "conv2d_gemm_cl_dx",
                                               "conv2d_gemm_dw", "conv2d_dw_reduce"]
    assert all("__bf16__" in k for k in gemm)
    # At most 4 input channels and 32x32 outputs or more (the RGB stem), the backward: 1x1 products of the
    # unfolded input, dx folded from fp32 columns; the 6x6 planes above keep the implicit GEMM. The forward
    # runs a row per program on the GPU except in TF32, the general kernel's few large programs in the interpreter.
    unfolded = products((2, 3, 64, 64), (16, 3, 7, 7), stride=2, padding=3)
    assert [k.split("__")[0] for k in unfolded] == ["conv2d_gemm_forward", "conv2d_pointwise_fp32_out", "fold2d",
                                                   "unfold2d", "conv2d_pointwise_dw", "conv2d_dw_reduce"]
    rows = products((2, 3, 64, 64), (16, 3, 7, 7), stride=2, padding=3, dtype=torch.bfloat16, backward=False)
    assert rows[0].startswith("conv2d_gemm_forward" if INTERPRETED else "conv2d_rows_forward")
    # Stride 1 and channels multiples of 16: dx is the forward kernel run on dy with the flipped weight,
    # unless the padding reaches past the kernel (then no forward convolution is dx). On planes of at most
    # 256 pixels the forward's first guess is the TMA boxes' kernel, on larger ones and strided the pointer one.
    forward_as_dx = products((2, 16, 6, 6), (32, 16, 3, 3), padding=1)
    # its copies: x and the weight in one launch, then dy and the transposed weight for dx
    assert [k.split("__")[0] for k in kernels_for((2, 16, 6, 6), (32, 16, 3, 3), padding=1)
            if k.startswith(LAYOUT_COPIES)][:3] == ["channels_last_copy_pair"] + ["channels_last_copy"] * 2
    assert [k.split("__")[0] for k in forward_as_dx[:2]] == ["conv2d_tma_forward"] * 2
    larger = products((2, 16, 17, 16), (32, 16, 3, 3), padding=1)  # 272 pixels
    assert [k.split("__")[0] for k in larger[:2]] == ["conv2d_gemm_cl_forward"] * 2
    assert products((2, 16, 7, 7), (32, 16, 3, 3), stride=2, padding=1)[0].startswith("conv2d_gemm_cl_forward")
    assert products((2, 16, 6, 6), (32, 16, 3, 3), padding=3)[1].startswith("conv2d_gemm_cl_dx")
    # fp32 at stride 1 on planes of at most 256 pixels (4096 with TF32 off): dw is one 1x1 product of the input
    # and dy unfolded rows-outer; 16-bit types keep the TMA boxes' dw.
    rows_outer = products((2, 16, 7, 7), (32, 16, 3, 3), padding=1)
    assert [k.split("__")[0] for k in rows_outer[-4:]] == ["unfold2d", "unfold2d", "conv2d_pointwise_dw",
                                                          "conv2d_dw_reduce"]
    assert products((2, 16, 7, 7), (32, 16, 3, 3), padding=1, dtype=torch.bfloat16)[-2].startswith("conv2d_tma_dw")
    # 272 pixels: the TMA dw with TF32 (on the GPU; the CPU's fp32 is IEEE, as torch's is there)
    assert products((2, 16, 17, 16), (32, 16, 3, 3), padding=1)[-2 if DEVICE == "cuda" else -4].startswith(
        "conv2d_tma_dw" if DEVICE == "cuda" else "unfold2d")
    with torch.backends.cudnn.flags(allow_tf32=False):  # full fp32 takes the rows-outer dw up to 4096 pixels
        assert products((2, 16, 17, 16), (32, 16, 3, 3), padding=1)[-4].startswith("unfold2d")
        assert products((2, 16, 65, 64), (32, 16, 3, 3), padding=1)[-2].startswith("conv2d_tma_dw")
    assert {cls.name for cls in KERNELS["conv2d"]} >= {k.split("__")[0] for k in depthwise + gemm + unfolded + rows
                                                       + rows_outer + forward_as_dx + larger}


@pytest.mark.parametrize("x_shape, w_shape, options", [
    ((2, 16, 6, 6), (16, 16, 3, 3), dict(padding=1, bias=True)),  # the TMA boxes' forward and dx, rows-outer dw
    ((2, 16, 7, 7), (32, 16, 3, 3), dict(stride=2, padding=1)),  # strided: the channels-last dw
    ((2, 16, 17, 16), (16, 16, 3, 3), dict(padding=1, dtype=torch.bfloat16)),  # the pointer forward, TMA dw
    ((2, 8, 6, 6), (12, 8, 3, 3), dict(padding=1)),  # NCHW kernels
    ((1, 3, 64, 64), (8, 3, 7, 7), dict(stride=2, padding=3, bias=True)),  # the unfolded input's 1x1 products
    ((2, 16, 5, 5), (24, 16, 1, 1), dict(bias=True)),  # 1x1 matrix products
    ((2, 8, 6, 6), (8, 1, 3, 3), dict(padding=1, groups=8)),  # depthwise
])
@pytest.mark.skipif(not INTERPRETED, reason="on the GPU precompile launches several candidates per kernel by design")
def test_precompile_launches_the_kernels_the_op_picks(x_shape, w_shape, options, monkeypatch):
    """`precompile` launches every candidate of every kernel; with one candidate each (the
    interpreter's), that is exactly what `kernels_for` names."""
    from nnkernels.functional.conv import precompile

    dtype = options.pop("dtype", torch.float32)
    x, w = randn(*x_shape, dtype=dtype), randn(*w_shape, dtype=dtype)
    bias = options.pop("bias", False)
    launched = set()
    checked_launch = KernelObject.checked_launch
    monkeypatch.setattr(KernelObject, "checked_launch", lambda kernel, args: launched.add(kernel.id) or
                        checked_launch(kernel, args))
    precompile(x, w, bias=bias, **options)
    copies = {"channels_last_copy", "channels_last_copy_pair"}  # what the layouts cost, not a choice
    assert {k for k in launched if k.split("__")[0] not in copies} == {
        k for k in kernels_for(x_shape, w_shape, bias=bias, dtype=dtype, **options) if k.split("__")[0] not in copies}

@pytest.mark.skipif(not INTERPRETED, reason="on the GPU precompile launches several candidates per kernel by design")
def test_precompile_of_one_backward_pass_launches_that_pass_alone(monkeypatch):
    """A background job builds a convolution's dw or its dx (`backward_passes`): each launches its own pass's kernels
    and none of the forward's, and the two together launch what the whole backward does."""
    from nnkernels.functional.conv import precompile

    x, w = randn(2, 8, 6, 6), randn(12, 8, 3, 3)
    launched = []
    checked_launch = KernelObject.checked_launch
    monkeypatch.setattr(KernelObject, "checked_launch", lambda kernel, args: launched.append(kernel.id) or
                        checked_launch(kernel, args))

    def ids(**options):
        launched.clear()
        precompile(x, w, padding=1, **options)
        return set(launched)

    forward, backward = ids(backward=False), ids(forward=False)
    dw, dx = (ids(forward=False, backward_passes=(part,)) for part in ("dw", "dx"))
    assert dw and dx and dw | dx == backward
    assert not {k.split("__")[0] for k in dw} & {k.split("__")[0] for k in dx if "copy" not in k}
    assert not (dw | dx) & (forward - backward)
    with pytest.raises(ValueError, match="backward_passes"):
        precompile(x, w, padding=1, backward_passes=("dz",))


def test_precompile_launches_only_a_remembered_choice(gpu_lists, monkeypatch):
    """Where tuning remembers a pass's choice (the cache or the shipped table), precompile launches that choice's
    kernels only, not the candidates quick tuning would time."""
    from nnkernels import launcher, tuning
    from nnkernels.functional.conv import precompile
    from nnkernels.functional.conv_algorithms import forward_pass
    from nnkernels.functional.conv import _listed_problem

    x, w = randn(2, 16, 6, 6), randn(16, 16, 3, 3)
    p = _listed_problem(x.shape, w.shape, 1, 1, 1, 1, x.dtype, False)
    forward = forward_pass(p)
    second = forward.candidates()[1]  # not the first guess: only a remembered choice picks it
    monkeypatch.setattr(tuning, "remembered",
                        lambda kind, key, candidates, decode: second if kind == "conv2d_forward" else None)
    launched = []
    monkeypatch.setattr(launcher.Launcher, "__call__", lambda self, *args: launched.append(self.kernel.id))
    precompile(x, w, padding=1, backward=False)
    assert launched == [k.id for k in forward.kernels(second)]


def test_choice_calls_run_each_passs_choices_in_order(gpu_lists, monkeypatch):
    """`choice_calls` lists every candidate of the forward, dx and dw (the GPU's lists), each call launching that
    choice's kernels and nothing else."""
    from nnkernels import launcher
    from nnkernels.functional.conv import _listed_problem, choice_calls
    from nnkernels.functional.conv_algorithms import dw_pass, dx_pass, forward_pass

    x, w = randn(2, 16, 6, 6), randn(16, 16, 3, 3)
    p = _listed_problem(x.shape, w.shape, 1, 1, 1, 1, x.dtype, False)
    passes = {"forward": forward_pass(p), "dx": dx_pass(p), "dw": dw_pass(p)}
    calls = choice_calls(x, w, padding=1)
    assert [(name, choice) for name, choice, _ in calls] == [
        (name, choice) for name, pass_ in passes.items() for choice in pass_.candidates()]
    launched = []
    monkeypatch.setattr(launcher.Launcher, "__call__", lambda self, *args: launched.append(self.kernel.id))
    for name, choice, call in calls:
        launched.clear()
        call()
        assert launched == [k.id for k in passes[name].kernels(choice)], (name, choice)


def test_tuning_picks_the_fastest_and_remembers_it(tmp_path, monkeypatch):
    """`choose` on a fake timer: the fastest config wins, lands in the JSON file, and is reused without
    listing the candidates again."""
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NNKERNELS_TUNE", "full")
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_full_key", lambda kind, key: f"{kind}|{key}")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    candidates = [Tile(64), Tile(128), Tile(32)]
    monkeypatch.setattr(tuning, "_time_ms", lambda run, config: {64: 3.0, 128: 1.0, 32: 2.0}[config.block_m])
    ran = []
    assert tuning.choose("conv", (1, 2), lambda: candidates, ran.append, lambda d: Tile(**d)) == candidates[1]
    assert set(ran) == set(candidates)  # each timed on the real tensors
    stored = json.loads((tmp_path / "tuning.json").read_text())
    assert stored["conv|(1, 2)"]["block_m"] == 128
    monkeypatch.setattr(tuning, "_memory", None)  # a new process: read back from the file
    ran.clear()

    assert tuning.choose("conv", (1, 2), lambda: candidates, ran.append, lambda d: Tile(**d)) == candidates[1]
    assert not ran  # remembered: nothing timed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuning.choose("conv", (9,), lambda: candidates, ran.append, lambda d: Tile(**d)) == candidates[0] and not ran


@pytest.fixture
def gpu_tuning(tmp_path, monkeypatch):
    """`choose` as on a GPU, with a fresh store in tmp_path and a fake timer: a config takes block_m ms."""
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NNKERNELS_TUNE", "full")
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "_time_ms", lambda run, config: float(config.block_m))


def test_the_shipped_table_answers_first_and_no_table_entry_or_cache_entry_is_trusted_blindly(gpu_tuning, tmp_path,
                                                                                               monkeypatch, caplog):
    """A choice shipped with the package answers a shape no cache holds, without timing; a shipped table that is
    not JSON is ignored with one warning; a stored choice that is not among the candidates (edited by hand, or from
    another version) is ignored and the shape tuned again."""
    monkeypatch.setattr(tuning, "_full_key", lambda kind, key: f"{kind}|{key}")
    candidates, ran = [Tile(64), Tile(32), Tile(16)], []
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"conv|(7,)": {"block_m": 32, "fails": False}}))
    monkeypatch.setattr(tuning, "SHIPPED_TABLE", table)
    tuning._shipped.cache_clear()
    try:
        assert tuning.choose("conv", (7,), lambda: candidates, ran.append, lambda d: Tile(**d)) == Tile(32)
        assert not ran
        table.write_text("{ truncated")
        tuning._shipped.cache_clear()
        with caplog.at_level("WARNING", logger="nnkernels"):
            assert tuning.choose("conv", (8,), lambda: candidates, ran.append, lambda d: Tile(**d)) == Tile(16)
        assert any("tuned.json" in r.getMessage() for r in caplog.records)
        (tmp_path / "tuning.json").write_text(json.dumps({"conv|(9,)": {"block_m": 48, "fails": False}}))
        monkeypatch.setattr(tuning, "_memory", None)
        ran.clear()
        assert tuning.choose("conv", (9,), lambda: candidates, ran.append, lambda d: Tile(**d)) == Tile(16)
        assert ran  # tuned again
    finally:
        tuning._shipped.cache_clear()


def test_a_config_that_runs_out_of_memory_drops_out(gpu_tuning):
    """A candidate whose scratch memory the GPU cannot hold (Winograd's matrices, say) is skipped, not fatal."""
    candidates = [Tile(16, fails=True), Tile(64)]

    def run(config):
        if config.fails:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 411.00 MiB")

    assert tuning.choose("conv", (5, 6), lambda: candidates, run, lambda d: Tile(**d)) == candidates[1]


def test_a_remembered_choice_is_answered_from_memory(gpu_tuning, monkeypatch):
    """After its first answer for a kind and shape, `choose` answers again without building the full key (19 µs
    of an eager step's host time on the H200 machine), until the store is read in again."""
    built = []
    monkeypatch.setattr(tuning, "_full_key", lambda kind, key: built.append(key) or f"{kind}|{key}")
    candidates = [Tile(64), Tile(32)]

    def choose():
        return tuning.choose("conv", (3, 4), lambda: candidates, lambda config: None, lambda d: Tile(**d))

    for _ in range(3):
        assert choose() == candidates[1]
    assert built == [(3, 4)]
    monkeypatch.setattr(tuning, "_memory", None)  # read in again (a test's store, say): the file answers
    assert choose() == candidates[1]
    assert built == [(3, 4), (3, 4)]


def test_a_remembered_choice_holds_only_for_the_kernel_sources_it_timed(monkeypatch):
    """A kernel whose code changes (a library upgrade) gets its layer's shapes tuned again: the key of a
    remembered choice changes with the code of any kernel of its layer's package (`ops/conv2d/`, with the shared
    `ops/common/`), and only with those (not with another layer's kernels, nor with a user's), and not with
    their comments, docstrings or line breaks."""
    from nnkernels import kernel
    from nnkernels.ops.batch_norm.train import BatchNorm2dPartialStats
    from nnkernels.ops.conv2d.pointwise import Conv2dPointwise

    def key():
        tuning.kernels_fingerprint.cache_clear()
        return tuning._full_key("conv2d_pointwise", (1, 2))

    try:
        before = key()
        assert key() == before
        source = Conv2dPointwise._kernel_source
        reworded = source.replace('"""', '"""Reworded. ', 1).replace("(", "(\n        ", 1) + "\n# a comment\n"
        monkeypatch.setattr(Conv2dPointwise, "_kernel_source", reworded)
        assert key() == before
        monkeypatch.setattr(Conv2dPointwise, "_kernel_source", source + "\n\ndef changed():\n    return 1\n")
        assert key() != before
        monkeypatch.undo()
        assert key() == before
        batch_norm_before = tuning._full_key("batch_norm_train_forward_split", (1, 2))
        monkeypatch.setattr(BatchNorm2dPartialStats, "_kernel_source",
                            BatchNorm2dPartialStats._kernel_source + "\n\ndef changed():\n    return 1\n")
        assert key() == before
        assert tuning._full_key("batch_norm_train_forward_split", (1, 2)) != batch_norm_before
        monkeypatch.undo()
        user_kernel = type("UserKernel", (), {"__module__": "user_code", "_kernel_source": "# a user's kernel"})
        monkeypatch.setitem(kernel._CATALOGUE, "UserKernel", user_kernel)
        assert key() == before
    finally:
        tuning.kernels_fingerprint.cache_clear()


def test_the_gpus_properties_are_asked_of_torch_once_per_device(monkeypatch):
    """Choices are per GPU model: the key holds the current device's name. It, the SM count (which candidate lists
    read) and the compute capability (whether the TMA kernels run: 9.0 and up) come from `get_device_properties`,
    asked once per device: 6.2 µs a call on the H200 machine."""
    from types import SimpleNamespace

    asked = []
    gpus = {0: SimpleNamespace(name="GPU zero", multi_processor_count=132, major=9, minor=0),
            1: SimpleNamespace(name="GPU one", multi_processor_count=108, major=8, minor=0)}
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or gpus[index])
    monkeypatch.setattr(machine, "INTERPRETED", False)
    machine.device_properties.cache_clear()
    machine._gpu.cache_clear()
    try:
        assert tuning._full_key("conv", (1,)).startswith("conv|(1,)|GPU zero|")
        assert tuning._full_key("conv", (2,)).startswith("conv|(2,)|GPU zero|")
        assert [machine.machine_of(torch.device("cuda")).sms for _ in range(2)] == [132, 132]
        current[0] = 1
        assert tuning._full_key("conv", (1,)).startswith("conv|(1,)|GPU one|")
        assert [machine.machine_of(torch.device("cuda", 1)).sms for _ in range(2)] == [108, 108]
        assert machine.machine_of(torch.device("cpu")).tma
        assert [machine.machine_of(torch.device("cuda", i)).tma for i in (0, 1, 0, 1)] == [True, False, True, False]
        assert asked == [0, 1]
    finally:
        machine.device_properties.cache_clear()
        machine._gpu.cache_clear()


@gpu
def test_tuning_times_the_gpu_not_the_launch():
    """A config that takes 2 ms of Python to launch a few-microsecond kernel times far below 2 ms:
    tuning compares what the kernels cost on the GPU, not the launch overhead every config shares."""
    counter = torch.zeros(1024, device="cuda")

    def run(config):
        time.sleep(0.002)
        counter.add_(1)

    assert tuning._time_ms(run, None) < 0.5


def test_interpreter_demo_shapes_use_one_program_per_kernel():
    """On the CPU the heuristic covers the CPU demo's layers with a single program per launch."""
    for ids in (kernels_for((64, 1, 8, 8), (8, 1, 3, 3), padding=1),
                kernels_for((64, 8, 8, 8), (16, 8, 3, 3), padding=1)):
        forward = ids[0].split("__")
        if DEVICE == "cpu":
            assert forward[-5] == "4096"  # BLOCK_M covers B*OH*OW = 4096 pixels


def test_a_slow_first_launch_is_logged_with_its_build(monkeypatch, caplog):
    """The first launches of a plan's kernels compile them (where no candidate was timed): that wait is the
    build's too, so a slow one logs its line; a later call of the shape logs nothing."""
    from nnkernels import launcher
    from nnkernels.functional import common

    first_launch = launcher.Launcher._checked
    slept = []

    def slow_first(self, args):
        if not slept:
            slept.append(True)
            time.sleep(0.3)  # stands for a compile
        return first_launch(self, args)

    monkeypatch.setattr(launcher.Launcher, "_checked", slow_first)
    monkeypatch.setattr(common, "SLOW_BUILD_S", 0.2)
    monkeypatch.setenv("NNKERNELS_TUNE", "off")
    x, w = torch.randn(1, 4, 6, 6), torch.randn(8, 4, 3, 3)
    with caplog.at_level("INFO", logger="nnkernels"):
        conv2d(x, w, padding=1)
        conv2d(x, w, padding=1)
    lines = [r.getMessage() for r in caplog.records if "to compile and tune" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("nnkernels: conv2d forward of 1x4x6x6: ")
