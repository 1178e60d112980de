"""`nnkernels bench model-convs`' parts that need no GPU: the layers found by forward hooks (with their counts,
string and non-zero padding modes, groups, dilation, asymmetric kernels), shape names and FLOPs, the models'
weighted totals, and the command line's checks of its arguments."""
import collections

import pytest
import torch

from nnkernels.bench.model_convs import model_totals
from nnkernels.layer_calls import ConvShape, conv_shapes
from nnkernels.cli import main


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.grouped = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4, bias=False)
        self.wide = torch.nn.Conv2d(8, 8, (1, 7), padding=(0, 3))

    def forward(self, x):
        return self.wide(self.grouped(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.block = Block()
        self.same = torch.nn.Conv2d(8, 8, 4, padding="same", bias=False)
        self.reflect = torch.nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect", bias=False)

    def forward(self, x):
        x = self.block(self.block(self.stem(x)))  # one block called twice: its layers count twice
        return self.reflect(self.same(x))


def test_conv_shapes_finds_every_call_with_its_options():
    found = conv_shapes(Net(), (2, 3, 16, 16))
    expected = collections.Counter({
        ConvShape((2, 3, 16, 16), (8, 3, 3, 3), (2, 2), (1, 1), (1, 1), 1, True): 1,
        ConvShape((2, 8, 8, 8), (8, 2, 3, 3), (1, 1), (2, 2), (2, 2), 4, False): 2,
        ConvShape((2, 8, 8, 8), (8, 8, 1, 7), (1, 1), (0, 3), (1, 1), 1, True): 2,
        # 'same' with an even span: torch pads one more on the right and bottom, seen here as a larger input
        ConvShape((2, 8, 9, 9), (8, 8, 4, 4), (1, 1), (1, 1), (1, 1), 1, False): 1,
        # reflect: F.pad first, then no padding
        ConvShape((2, 8, 10, 10), (8, 8, 3, 3), (1, 1), (0, 0), (1, 1), 1, False): 1,
    })
    assert found == expected
    for shape in found:  # the output each shape names is the one the layer gives
        assert shape.y_shape[2:] == (8, 8)


def test_a_transposed_convolution_counts_as_the_convolution_it_runs():
    """From its output to its input, without bias: the convolution whose input gradient it is, which warmup then
    compiles (forward, dx and dw: what the transposed layer's forward and backward run)."""
    up = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
    found = conv_shapes(up, (2, 8, 8, 8))
    shape = ConvShape((2, 4, 16, 16), (8, 4, 3, 3), (2, 2), (1, 1), (1, 1), 1, False)
    assert found == collections.Counter({shape: 1}) and shape.y_shape == (2, 8, 8, 8)


def test_shape_names_and_flops():
    grouped = ConvShape((2, 8, 8, 8), (8, 2, 3, 3), (1, 1), (2, 2), (2, 2), 4, False)
    assert grouped.name == "3x3 8->8 8x8 p2 d2 g4"
    assert grouped.flops() == 2 * 2 * 8 * 8 * 8 * 2 * 9
    strided = ConvShape((1, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1, True)
    assert strided.name == "7x7 3->64 224x224 s2 p3 +bias" and strided.y_shape == (1, 64, 112, 112)
    assert ConvShape((1, 8, 8, 8), (8, 8, 1, 7), (1, 1), (0, 3), (1, 1), 1, False).name == "1x7 8->8 8x8 p0x3"


def test_model_totals_weigh_each_layer_by_its_count():
    a = ConvShape((1, 8, 8, 8), (8, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    b = ConvShape((1, 8, 8, 8), (16, 8, 1, 1), (1, 1), (0, 0), (1, 1), 1, False)
    counts = {"one": collections.Counter({a: 3}), "two": collections.Counter({a: 1, b: 2})}
    timed = {("ours", "forward"): 1.0, ("torch", "forward"): 2.0, ("ours", "backward"): 3.0,
             ("torch", "backward"): 5.0}
    times = {(a, "bf16", "nchw"): timed, (b, "bf16", "nchw"): {key: 10 * ms for key, ms in timed.items()}}
    totals = model_totals(counts, times)
    assert totals["one", "bf16", "nchw", "forward"] == (3.0, 6.0)
    assert totals["two", "bf16", "nchw", "forward"] == (1.0 + 2 * 10.0, 2.0 + 2 * 20.0)
    assert totals["two", "bf16", "nchw", "backward"] == (3.0 + 2 * 30.0, 5.0 + 2 * 50.0)
    assert len(totals) == 4


@pytest.mark.parametrize("argv, words", [
    (["bench", "model-convs", "resnet9"], "unknown model(s) resnet9"),
    (["bench", "model-convs", "--precisions", "bf16,fp64"], "comma-separated list of bf16, tf32, fp32"),
    (["bench", "conv2d", "--batch", "3"], "only the model-convs suite takes them"),
])
def test_bad_arguments_are_refused_by_name(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_resnet50_layers_are_those_of_the_resnet50_suite():
    pytest.importorskip("torchvision", reason="torchvision comes with the bench extra")
    from nnkernels.bench.model_convs import model_shapes
    from nnkernels.bench.resnet50_convs import RESNET50

    found = model_shapes("resnet50", batch=64)
    assert sum(found.values()) == 53
    assert sorted((s.x_shape[1], s.w_shape[0], s.x_shape[2], s.w_shape[2], s.stride[0], n) for s, n in found.items()) \
        == sorted((l.c_in, l.c_out, l.size, l.kernel, l.stride, l.count) for l in RESNET50)
