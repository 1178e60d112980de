"""Strided subsampling (`Subsample2dForward`, `subsample`), its adjoint (`Subsample2dBackward`,
`subsample_backward`) and the NHWC -> NCHW copy (`channels_first`): bit-exact against torch's
slicing and permutes for every dtype, on planes that are not multiples of the stride or of the
tiles, outputs poisoned; bad launches write nothing."""
import pytest
import torch
from support import DTYPES, dtype_id, poisoned, randn

from nnkernels.functional.layout import channels_first, subsample, subsample_backward
from nnkernels.ops.conv2d.subsample import Subsample2dBackward, Subsample2dForward, subsample_tiles

# (N, C, H, W), stride
CASES = [((2, 3, 7, 9), (2, 2)), ((1, 4, 5, 8), (2, 3)), ((3, 2, 1, 6), (3, 1)), ((2, 5, 4, 4), (1, 1))]


def _assert_same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ (NaN: unwritten)"


def _adjoint_reference(grad, shape, stride):
    x = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
    x[:, :, ::stride[0], ::stride[1]] = grad
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, stride", CASES, ids=lambda v: "x".join(map(str, v)))
def test_subsample_and_its_adjoint_equal_slicing(shape, stride, dtype):
    x = randn(*shape, dtype=dtype)
    y = subsample(x, stride)
    _assert_same(y, x[:, :, ::stride[0], ::stride[1]].contiguous())
    grad = randn(*y.shape, dtype=dtype)
    _assert_same(subsample_backward(grad, shape, stride), _adjoint_reference(grad, shape, stride))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_kernels_on_ragged_tiles_write_every_element(dtype):
    """Planes spread over several programs both ways (3 planes of 2 per tile, 35 pixels in 16s)."""
    rows, h, w, stride = 5, 7, 5, (2, 2)
    oh, ow = 4, 3
    x = randn(rows, 1, h, w, dtype=dtype)
    y = poisoned(rows, 1, oh, ow, dtype=dtype)
    Subsample2dForward(*stride, 2, 4, dtype=dtype).launch(x, y, rows, h, w, oh, ow)
    _assert_same(y, x[:, :, ::2, ::2].contiguous())
    back = poisoned(rows, 1, h, w, dtype=dtype)
    Subsample2dBackward(*stride, 2, 16, dtype=dtype).launch(y, back, rows, h, w, oh, ow)
    _assert_same(back, _adjoint_reference(y, (rows, 1, h, w), stride))


def test_tiles_cover_small_planes_whole():
    block_r, block_p = subsample_tiles(49)
    assert block_p == 64 and block_r * block_p == subsample_tiles(10**6)[0] * subsample_tiles(10**6)[1]


def test_launch_refuses_wrong_sizes_and_writes_nothing():
    x = randn(2, 3, 7, 9)
    y = poisoned(2, 3, 4, 5)
    kernel = Subsample2dForward(2, 2, 8, 64)
    for args, message in [((x, y, 6, 7, 9, 3, 5), r"^OH: expected cdiv\(H, stride\) = 4, got 3"),
                          ((x, poisoned(2, 3, 4, 4), 6, 7, 9, 4, 5),
                           r"^y: expected ROWS\*OH\*OW = 120 elements, got 96"),
                          ((x, y, 5, 7, 9, 4, 5), r"^x: expected ROWS\*H\*W = 315 elements, got 378")]:
        with pytest.raises(ValueError, match=message):
            kernel.launch(*args)
        assert torch.isnan(y).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(2, 5, 7, 3), (1, 9, 9, 70), (3, 1, 1, 16)], ids=lambda s: "x".join(map(str, s)))
def test_channels_first_equals_permute(shape, dtype):
    t = randn(*shape, dtype=dtype)
    _assert_same(channels_first(t), t.permute(0, 3, 1, 2).contiguous())
