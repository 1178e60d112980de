"""NCHW -> NHWC copies (`ChannelsLastCopy`, `channels_last`; a convolution's input and weight in one launch,
`ChannelsLastCopyPair`, `channels_last_pair`): bit-exact against `t.permute(0, 2, 3, 1).contiguous()` for every
dtype, on ragged tiles, tiny channel and pixel counts (conv weights), and batches past CUDA's 65535 on the GPU;
bad input writes nothing."""
import pytest
import torch
from support import DEVICE, DTYPES, dtype_id, gpu, poisoned, randn

from nnkernels.kernel import INT32_MAX
from nnkernels.functional.layout import channels_last, channels_last_pair
from nnkernels.ops.common.layout import ChannelsLastCopy, ChannelsLastCopyPair, channels_last_tiles


def reference(t):
    return t.permute(0, 2, 3, 1).contiguous()


def assert_same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{out.shape} {out.dtype} != {ref.shape} {ref.dtype}"
    assert out.is_contiguous()
    assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ (NaN: unwritten)"


SHAPES = [(2, 3, 5, 7), (1, 1, 1, 1), (3, 17, 1, 1), (2, 64, 9, 9), (20, 3, 7, 7)]  # (20, 3, 7, 7): a conv weight


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_channels_last_equals_permute(shape, dtype):
    t = randn(*shape, dtype=dtype)
    assert_same(channels_last(t), reference(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape, tiles",
    [((2, 37, 5, 7), (16, 16, 1, 1)),  # C over 3 tiles and HW = 35 over 3 tiles, both ragged
     ((2, 70, 9, 9), (64, 64, 2, 1)),  # the GPU's tiles: C = 70 and HW = 81 each spill into a second tile
     ((2, 300, 3, 3), (256, 16, 4, 1)),  # a 3x3 weight's tiles: C = 300 spills into a second tile, HW = 9 of 16
     ((2, 24, 14, 14), (16, 64, 8, 4)),  # rows told multiples of 8 (C) and 4 (HW = 196), both ragged in tiles
     ((2, 3, 1, 2), (1, 1, 1, 2))],  # one element per program
    ids=["16x16", "64x64-c-align-2", "256x16-c-align-4", "16x64-aligned-8-4", "1x1"],
)
def test_kernel_object_writes_every_element(shape, tiles, dtype):
    """(BLOCK_C, BLOCK_P, C_ALIGN, HW_ALIGN); the alignments powers of two dividing C and HW."""
    b, c, h, w = shape
    x = randn(*shape, dtype=dtype)
    y = poisoned(b, h, w, c, dtype=dtype)
    ChannelsLastCopy(*tiles, dtype=dtype).launch(x, y, b, c, h * w)
    assert_same(y, reference(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "x_shape, w_shape",
    [((2, 37, 5, 7), (20, 37, 3, 3)),  # ragged C and HW; a 3x3 weight
     ((3, 64, 9, 9), (70, 64, 3, 3)),  # C_OUT = 70 over the GPU's weight tiles
     ((1, 16, 4, 4), (16, 16, 1, 1)),  # one tap
     ((0, 16, 4, 4), (16, 16, 3, 3))],  # an empty batch: two launches, the weight's alone
    ids=["ragged", "70-out", "1x1", "empty-batch"],
)
def test_channels_last_pair_equals_permute_of_both(x_shape, w_shape, dtype):
    x, weight = randn(*x_shape, dtype=dtype), randn(*w_shape, dtype=dtype)
    x_cl, weight_cl = channels_last_pair(x, weight)
    assert_same(x_cl, reference(x))
    assert_same(weight_cl, reference(weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_pair_kernel_object_writes_every_element_of_both(dtype):
    """Interpreter-sized tiles that leave ragged edges in both copies: C = 37 and HW = 35 over 16 x 16 tiles,
    C_IN = 20 and 9 taps over 16 x 8."""
    x, weight = randn(2, 37, 5, 7, dtype=dtype), randn(12, 20, 3, 3, dtype=dtype)
    y, weight_cl = poisoned(2, 5, 7, 37, dtype=dtype), poisoned(12, 3, 3, 20, dtype=dtype)
    ChannelsLastCopyPair(16, 16, 16, 8, 1, dtype=dtype).launch(x, y, 2, 37, 35, weight, weight_cl, 12, 20, 9)
    x, y = randn(2, 32, 14, 14, dtype=dtype), poisoned(2, 14, 14, 32, dtype=dtype)  # HW = 196 told 4 | HW
    ChannelsLastCopyPair(16, 64, 16, 8, 4, dtype=dtype).launch(x, y, 2, 32, 196, weight, weight_cl, 12, 20, 9)
    assert_same(y, reference(x))
    assert_same(y, reference(x))
    assert_same(weight_cl, reference(weight))


def test_pair_kernel_object_refuses_and_writes_nothing():
    kernel = ChannelsLastCopyPair(16, 16, 16, 16, 1)
    x, weight = randn(2, 3, 4, 5), randn(4, 3, 3, 3)
    x_before, weight_before = x.clone(), weight.clone()
    y, weight_cl = poisoned(2, 4, 5, 3), poisoned(4, 3, 3, 3)
    sizes = (4, 3, 9)
    for args, exception, message in [
        ((x, y, 2, 3, 20, weight, poisoned(4, 3, 3, 2), *sizes), ValueError,
         r"^w_cl: expected C_OUT\*TAPS\*C_IN = 108 elements, got 72"),
        ((x, y, 2, 3, 20, weight, weight_cl, 4, 3, 8), ValueError, r"^w: expected C_OUT\*C_IN\*TAPS = 96 elements"),
        ((x, y, 2, 3, 20, weight.half(), weight_cl, *sizes), TypeError, r"^w: expected dtype torch.float32"),
        ((x, y, 2, 3, 20, y.view(-1)[:108].view(4, 3, 3, 3), weight_cl, *sizes), ValueError,
         r"^y: expected memory that does not overlap w's"),
        ((x, y, 2, 3, 20, weight, x.view(-1)[:108], *sizes), ValueError, r"^w_cl: expected memory that does not "
                                                                         r"overlap x's"),
        ((x, y, 2, 3, 20, weight, y.view(-1)[:108], *sizes), ValueError, r"^w_cl: expected memory that does not "
                                                                         r"overlap y's"),
    ]:
        with pytest.raises(exception, match=message):
            kernel.launch(*args)
        assert torch.isnan(y).all() and torch.isnan(weight_cl).all()
        assert torch.equal(x, x_before) and torch.equal(weight, weight_before)


def test_channels_last_pair_refuses_weights_of_another_dtype():
    with pytest.raises(ValueError, match=r"^weight: expected dtype torch.float32 like x, got torch.float16"):
        channels_last_pair(randn(2, 3, 4, 4), randn(4, 3, 3, 3, dtype=torch.float16))


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 3, 3), (2, 3, 0, 5)])
def test_empty_tensors_give_an_empty_result(shape):
    t = randn(*shape)
    assert_same(channels_last(t), reference(t))


def test_tiles():
    compiled = {hw: channels_last_tiles(3, hw, interpreted=False) for hw in (1, 9, 31, 32, 49, 63, 64, 196, 10**6)}
    assert compiled == {1: (256, 16), 9: (256, 16), 31: (256, 16), 32: (128, 32), 49: (128, 32), 63: (128, 32),
                        64: (64, 64), 196: (64, 64), 10**6: (64, 64)}
    for c, hw in ((3, 9), (64, 81), (1, 10**6), (10**6, 1), (70, 3136)):
        block_c, block_p = channels_last_tiles(c, hw, interpreted=True)
        assert block_c * block_p <= 4096
        assert block_c >= min(c, 64) and block_p >= min(hw, 4096 // block_c), "a tile covers what it can"


@pytest.mark.parametrize(
    "make, exception, message",
    [pytest.param(lambda: randn(2, 3, 4), ValueError, r"^t: expected a 4-D", id="3-d"),
     pytest.param(lambda: torch.ones(2, 3, 4, 4, dtype=torch.int32, device=DEVICE), TypeError, r"^t: expected dtype",
                  id="int32"),
     pytest.param(lambda: randn(2, 3, 4, 4, dtype=torch.float64), TypeError, r"^t: expected dtype", id="float64"),
     pytest.param(lambda: randn(2, 4, 4, 3).permute(0, 3, 1, 2), ValueError, r"^t: expected a contiguous",
                  id="strided"),
     pytest.param(lambda: [[1.0]], TypeError, r"^t: expected a torch.Tensor", id="list")],
)
def test_channels_last_refuses(make, exception, message):
    with pytest.raises(exception, match=message):
        channels_last(make())


def test_kernel_object_refuses_and_writes_nothing():
    kernel = ChannelsLastCopy(16, 16, 1, 1)
    x = randn(2, 3, 4, 5)
    x_before = x.clone()
    y = poisoned(2, 4, 5, 3)
    for args, exception, message in [
        ((x, poisoned(2, 4, 5, 2), 2, 3, 20), ValueError, r"^y: expected B\*HW\*C = 120 elements, got 80"),
        ((x, y, 2, 3, 21), ValueError, r"^x: expected B\*C\*HW = 126 elements, got 120"),
        ((x, y, 2, 3, 0), ValueError, r"^HW: expected an int in \[1, 2\*\*31 - 1\]"),
        ((x, y, 1, 2**16, 2**15), ValueError, r"^C, HW: expected C\*HW <= 2\*\*31 - 1 elements per image"),
        ((x, y.double(), 2, 3, 20), TypeError, r"^y: expected dtype torch.float32"),
        ((x, y.view(2, 20, 3).transpose(1, 2), 2, 3, 20), ValueError, r"^y: expected a contiguous tensor"),
        ((x, x, 2, 3, 20), ValueError, r"^y: expected memory that does not overlap x's"),
        ((x, y, 2, 3), TypeError, r"launch takes 5 arguments"),
    ]:
        with pytest.raises(exception, match=message):
            kernel.launch(*args)
        assert torch.isnan(y).all() and torch.equal(x, x_before)
    with pytest.raises(ValueError, match=r"^C_ALIGN: expected a power of two dividing C = 20, got 8"):
        ChannelsLastCopy(16, 16, 8, 1).launch(x, y, 2, 20, 3)
    with pytest.raises(ValueError, match=r"^HW_ALIGN: expected a power of two dividing HW = 20, got 8"):
        ChannelsLastCopy(16, 16, 1, 8).launch(x, y, 2, 3, 20)
    assert torch.isnan(y).all()


def test_impossible_grid_is_a_clear_error():
    """1x1 tiles on 2**32 elements (meta tensors: sizes without memory) need more programs than a grid holds."""
    x = torch.empty(2**16, 2**8, 2**8, device="meta")
    y = torch.empty(2**16, 2**8, 2**8, device="meta")
    with pytest.raises(ValueError, match=r"^grid: 4294967296 programs exceed the 2\*\*31 - 1"):
        ChannelsLastCopy(1, 1, 1, 1).launch(x, y, 2**16, 2**8, 2**8)
    assert 2**16 * 2**8 * 2**8 > INT32_MAX


@gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((70000, 2, 1, 1), torch.float32),  # a batch past grid axes 1 and 2's limit of 65535
     ((100000, 3, 3, 3), torch.bfloat16),  # a weight with 100000 output channels
     ((32, 64, 56, 56), torch.bfloat16)],  # the shape the kernel was measured on
    ids=["batch-70000", "weight-100000", "B32-C64-56x56"],
)
def test_large_batches_on_the_gpu(shape, dtype):
    t = randn(*shape, dtype=dtype)
    assert_same(channels_last(t), reference(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES + [(0, 4, 3, 3)], ids=lambda s: "x".join(map(str, s)))
def test_the_ops_layout_changes_equal_torchs(shape, dtype, monkeypatch):
    """`nchw` and `as_channels_last` (what the ops read channels-last inputs and write channels-last outputs
    with) equal torch's `contiguous` in either direction bit for bit, through the tile transpose."""
    from nnkernels.functional import layout
    from nnkernels.launcher import Launcher

    launched = []
    call = Launcher.__call__
    monkeypatch.setattr(Launcher, "__call__", lambda self, *args: launched.append(self.kernel.id) or call(self, *args))
    t = randn(*shape, dtype=dtype)
    cl = t.contiguous(memory_format=torch.channels_last)
    back, forth = layout.nchw(cl), layout.as_channels_last(t)
    assert back.is_contiguous() and torch.equal(back, t)
    assert forth.is_contiguous(memory_format=torch.channels_last) and torch.equal(forth, t)
    transposes = int(not cl.is_contiguous()) + int(not t.is_contiguous(memory_format=torch.channels_last))
    assert len(launched) == (transposes if t.numel() else 0)
    assert layout.nchw(t) is t and layout.as_channels_last(cl) is cl


def test_the_ops_layout_changes_leave_other_tensors_to_torch():
    """A view at an address the cached launches were not specialised for, and strides neither layout has, take
    torch's own copy."""
    from nnkernels.functional import layout

    base = randn(2 * 3 * 5 * 7 + 1)
    odd = base[1:].view(2, 5, 7, 3).permute(0, 3, 1, 2)  # channels-last strides, 4 bytes off 16-byte alignment
    assert torch.equal(layout.nchw(odd), odd.contiguous()) and layout.nchw(odd).is_contiguous()
    sliced = randn(2, 6, 5, 7)[:, ::2]
    assert torch.equal(layout.nchw(sliced), sliced.contiguous())
    assert torch.equal(layout.as_channels_last(sliced), sliced)
    assert layout.as_channels_last(sliced).is_contiguous(memory_format=torch.channels_last)
