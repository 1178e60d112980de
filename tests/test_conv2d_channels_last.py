"""conv2d on channels-last tensors: the output and the input gradient in the layout torch's convolution gives
(channels-last where x or the weight is), values within each dtype's tolerance of float64, and the
channels-last kernels reading x and dy and writing y and dx in place (only the weight is copied).

References: torch.nn.functional.conv2d and its autograd in float64 on the same data; layouts judged as torch
judges them, `is_contiguous(memory_format=...)` both ways.
"""
import pytest
import torch
import torch.nn.functional as F

from nnkernels.functional.common import last_kernels
from nnkernels.functional.conv import conv2d, kernels_for
from support import DEVICE, DTYPES, assert_close, assert_conv2d_matches_float64, dtype_id, randn

CL = torch.channels_last

# (B, C_IN, C_OUT, H, W, (KH, KW), stride, padding, dilation, groups, bias): every algorithm's path once.
CASES = [
    pytest.param((2, 16, 32, 6, 5, (3, 3), 1, 1, 1, 1, True), id="3x3-channels-last-kernels"),
    pytest.param((2, 16, 32, 6, 5, (1, 1), 1, 0, 1, 1, True), id="1x1-as-nhwc-products"),
    pytest.param((2, 32, 16, 7, 6, (3, 3), 2, 1, 1, 1, False), id="3x3-stride2-dx-nhwc"),
    pytest.param((2, 32, 16, 7, 6, (1, 1), 2, 0, 1, 1, True), id="1x1-stride2"),
    pytest.param((1, 16, 16, 6, 7, (3, 3), 1, 3, 1, 1, True), id="padding-past-the-kernel"),
    pytest.param((2, 16, 32, 9, 8, (1, 7), 1, (0, 3), 2, 1, False), id="1x7-dilated"),
    pytest.param((2, 3, 16, 11, 10, (7, 7), 2, 3, 1, 1, True), id="stem-through-nchw"),
    pytest.param((2, 16, 16, 6, 6, (3, 3), 1, 1, 1, 16, True), id="depthwise-channels-last-kernels"),
    pytest.param((2, 8, 16, 6, 6, (3, 3), 1, 1, 1, 2, False), id="grouped-channels-last-kernels"),
    pytest.param((2, 24, 16, 5, 5, (3, 3), 1, 1, 1, 1, True), id="24-channels-in"),
    pytest.param((2, 40, 24, 7, 6, (3, 3), 2, 1, 1, 1, False), id="3x3-stride2-40-to-24-masked-slices"),
    pytest.param((2, 24, 40, 6, 5, (1, 1), 1, 0, 1, 1, True), id="1x1-24-to-40-masked-slices"),
]


def _tensors(case, dtype, x_format=CL, w_format=torch.contiguous_format):
    B, C_IN, C_OUT, H, W, kernel, stride, padding, dilation, groups, has_bias = case
    x = randn(B, C_IN, H, W, dtype=dtype).contiguous(memory_format=x_format).requires_grad_()
    w = randn(C_OUT, C_IN // groups, *kernel, dtype=dtype).contiguous(memory_format=w_format).requires_grad_()
    b = randn(C_OUT, dtype=dtype).requires_grad_() if has_bias else None
    return x, w, b, (stride, padding, dilation, groups)


def formats(t):
    return t.is_contiguous(), t.is_contiguous(memory_format=CL)


def _check(case, dtype, dy_format, x_format=CL, w_format=torch.contiguous_format):
    x, w, b, options = _tensors(case, dtype, x_format, w_format)
    y = conv2d(x, w, b, *options)
    dy = randn(*y.shape, dtype=dtype).contiguous(memory_format=dy_format)
    leaves = (x, w) + ((b,) if b is not None else ())
    grads = torch.autograd.grad(y, leaves, dy)
    torch_x = x.detach().float().cpu().requires_grad_()
    torch_y = F.conv2d(torch_x, w.detach().float().cpu(), None, *options)
    torch_dx = torch.autograd.grad(torch_y, torch_x, dy.float().cpu())[0]
    assert formats(y) == formats(torch_y), (y.stride(), torch_y.stride())
    assert formats(grads[0]) == formats(torch_dx), (grads[0].stride(), torch_dx.stride())
    assert_conv2d_matches_float64(y, grads, leaves, dy, options, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES)
def test_channels_last_conv2d_matches_float64_in_torchs_layout(case, dtype):
    with torch.backends.cudnn.flags(allow_tf32=False):
        _check(case, dtype, CL)


@pytest.mark.parametrize("case", CASES[:4])
def test_a_contiguous_dy_is_taken_too(case):
    """Autograd may hand a channels-last output a contiguous gradient: dy is made channels-last first."""
    _check(case, torch.bfloat16, torch.contiguous_format)


@pytest.mark.parametrize("case", [CASES[0], CASES[6]])
def test_a_channels_last_weight_gives_a_channels_last_output_as_in_torch(case):
    _check(case, torch.bfloat16, CL, x_format=torch.contiguous_format, w_format=CL)


def _copies(ids):
    return [k for k in ids if k.startswith("channels_last_copy")]  # the tile transpose, either direction


@pytest.mark.parametrize("c_in, c_out", [(16, 32), (24, 40)], ids=["channels-in-16s", "channels-in-8s"])
def test_the_channels_last_kernels_copy_only_the_weight(c_in, c_out):
    """3x3 and 1x1 layers, with channels in 16s or not (the last K slice masked): forward and backward read x and
    dy where they lie and write y and dx there; the only layout copies are the weight's: for the forward (none for
    a 1x1 weight, already [C_OUT, 1, 1, C_IN]), and transposed for dx. A 1x1 layer not in 16s runs, in the
    interpreter, its NCHW product through copies; on a GPU tuning picks that or the channels-last kernels."""
    for kernel, padding, copies in (((3, 3), 1, 2), ((1, 1), 0, 1)):
        case = (2, c_in, c_out, 6, 5, kernel, 1, padding, 1, 1, True)
        x, w, b, options = _tensors(case, torch.bfloat16)
        y = conv2d(x, w, b, *options)
        y.backward(randn(*y.shape, dtype=torch.bfloat16).contiguous(memory_format=CL))
        launched = last_kernels("conv2d")
        ids = launched["forward"] + launched["backward"]
        through_nchw = ids[1].startswith("conv2d_pointwise__")
        if kernel == (1, 1) and c_in % 16 and (through_nchw or DEVICE == "cpu"):
            # The interpreter's one candidate there is the first guess, the NCHW product through copies.
            assert through_nchw and len(_copies(ids)) > copies, ids
            assert kernels_for(x.shape, w.shape, 1, padding, dtype=torch.bfloat16, bias=True, channels_last=True) == ids
            continue
        assert len(_copies(ids)) == copies, ids
        assert not _copies(launched["forward"]) or kernel == (3, 3)
        listed = kernels_for(x.shape, w.shape, 1, padding, dtype=torch.bfloat16, bias=True, channels_last=True)
        assert listed == ids
        nchw = kernels_for(x.shape, w.shape, 1, padding, dtype=torch.bfloat16, bias=True)
        if kernel == (3, 3):  # NCHW tensors: the channels-last kernels through copies in 16s, else NCHW kernels
            assert len(_copies(nchw)) > 2 if c_in % 16 == 0 else not _copies(nchw)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_a_channels_last_weight_is_read_where_it_lies(dtype, monkeypatch):
    """A model moved to channels_last has channels-last weights: the forward reads the weight as it is stored,
    copying nothing (it used to copy it to NCHW and back), and the backward's dx takes it NCHW. Values against
    float64, and the copies counted both ways."""
    from nnkernels.functional import layout

    transposes = []
    real = layout.channels_first_copy

    def counted(*args):
        copy = real(*args)
        return lambda t: transposes.append(t.shape) or copy(t)

    monkeypatch.setattr(layout, "channels_first_copy", counted)
    layout._cached_copy.cache_clear()
    case = (2, 16, 32, 6, 5, (3, 3), 1, 1, 1, 1, True)
    x, w, b, options = _tensors(case, dtype, w_format=CL)
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = conv2d(x, w, b, *options)
        assert not _copies(last_kernels("conv2d")["forward"]) and not transposes
        assert kernels_for(x.shape, w.shape, 1, 1, dtype=dtype, bias=True, weight_channels_last=True,
                           backward=False) == last_kernels("conv2d")["forward"]
        dy = randn(*y.shape, dtype=dtype).contiguous(memory_format=CL)
        grads = torch.autograd.grad(y, (x, w, b), dy)
    assert transposes == [(32, 3, 3, 16)]  # the weight to NCHW for dx, once
    assert_conv2d_matches_float64(y, grads, (x, w, b), dy, options, dtype)
    layout._cached_copy.cache_clear()


def test_a_layer_on_nchw_kernels_copies_in_and_out():
    """The stem (3 channels in) reads NCHW: x and dy are copied to NCHW, y and dx back, each by the tile
    transpose."""
    case = (2, 3, 16, 11, 10, (7, 7), 2, 3, 1, 1, False)
    x, w, b, options = _tensors(case, torch.float32)
    y = conv2d(x, w, b, *options)
    assert y.is_contiguous(memory_format=CL) and not y.is_contiguous()
    y.backward(randn(*y.shape).contiguous(memory_format=CL))
    launched = last_kernels("conv2d")
    assert [k.split("__")[0] for k in launched["forward"]] == ["channels_last_copy", "conv2d_gemm_forward",
                                                              "channels_last_copy"]
    assert x.grad.is_contiguous(memory_format=CL)


def test_empty_batch_keeps_the_layout():
    x = torch.empty(0, 16, 5, 5, device=DEVICE).contiguous(memory_format=CL).requires_grad_()
    w = randn(32, 16, 3, 3).contiguous(memory_format=CL)
    y = conv2d(x, w, padding=1)
    assert y.shape == (0, 32, 5, 5) and y.is_contiguous(memory_format=CL)


def test_opcheck_channels_last():
    """The custom operator's fake implementation gives the real output's strides (torch.compile relies on it)."""
    x = randn(2, 16, 5, 5).contiguous(memory_format=CL).requires_grad_()
    w, b = randn(32, 16, 3, 3).requires_grad_(), randn(32).requires_grad_()
    torch.library.opcheck(torch.ops.nnkernels.conv2d.default, (x, w, b, [1, 1], [1, 1], [1, 1], 1))


def test_wrong_channel_count_in_channels_last_is_the_clear_error():
    x = randn(2, 12, 5, 5).contiguous(memory_format=CL)
    with pytest.raises(ValueError, match="input: expected 16 channels"):
        conv2d(x, randn(32, 16, 3, 3), padding=1)


def test_channels_last_outputs_may_be_modified_in_place():
    """conv2d, batch_norm and avg_pool2d give channels-last outputs that are tensors of their own, not views, so
    an in-place ReLU after them (torchvision's ResNets) is allowed by autograd and its gradient is right."""
    from nnkernels.functional import avg_pool2d, batch_norm

    x = randn(2, 16, 6, 6).contiguous(memory_format=CL).requires_grad_()
    w, depthwise = randn(16, 16, 3, 3).requires_grad_(), randn(16, 1, 3, 3)
    ops = [lambda t: conv2d(t, w, padding=1), lambda t: batch_norm(t, None, None, training=True),
           lambda t: avg_pool2d(t, 2), lambda t: conv2d(t, depthwise, padding=1, groups=16)]
    for op in ops:
        y = op(x)
        assert y.is_contiguous(memory_format=CL) and not y._is_view()
        out = torch.relu_(op(x))
        dy = randn(*out.shape).contiguous(memory_format=CL)
        grad = torch.autograd.grad(out, x, dy)[0]
        expected = torch.autograd.grad(torch.relu(op(x)), x, dy)[0]
        assert torch.equal(grad, expected)


@pytest.mark.parametrize("c_in, c_out", [(32, 48), (24, 40)], ids=["channels-in-16s", "channels-in-8s"])
def test_a_1x1_layer_is_tiled_as_one_row_of_all_its_pixels(c_in, c_out, gpu_lists, poisoned_outputs):
    """A channels-last stride-1 1x1 layer of three 7x7 images: the channels-last and TMA kernels take its 147 pixels
    as one image of one row (no tile stops at an image's edge); every candidate of the forward, dx and dw on the
    GPU's lists gives the float64 result, every element written."""
    from nnkernels.functional.conv import _listed_problem, choice_calls

    x = randn(3, c_in, 7, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = randn(c_out, c_in, 1, 1, dtype=torch.bfloat16)
    dy = randn(3, c_out, 7, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    p = _listed_problem(x.shape, w.shape, 1, 0, 1, 1, x.dtype, True, True, False)
    assert p.flat_pixels and p.grid_sizes == (1, c_in, c_out, 1, 147, 1, 147)
    ref_x, ref_w = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    ref_y = F.conv2d(ref_x, ref_w)
    ref_dx, ref_dw = torch.autograd.grad(ref_y, (ref_x, ref_w), dy.double().cpu())
    dy64 = dy.double().cpu()
    # (reference, the scale of its terms): a bias gradient sums 147 terms that can cancel
    expected = {"forward": [(ref_y, 0.0)], "dx": [(ref_dx, 0.0)],
                "dw": [(ref_dw, 0.0), (dy64.sum((0, 2, 3)), float(dy64.abs().sum((0, 2, 3)).norm()))]}
    ran = []
    for name, choice, call in choice_calls(x, w, bias=True, dy=dy):
        out = call()
        for got, (ref, floor) in zip(out if name == "dw" else (out,), expected[name], strict=True):
            assert_close(got.cpu(), ref.detach(), torch.bfloat16, floor=floor)
        ran.append(name)
    assert {"forward", "dx", "dw"} == set(ran) and len(ran) > 6, ran
