"""nnkernels.nn.convert: in-place swap of supported torch layers, sharing Parameters and buffers,
leaving the rest with a reason, and the converted model computing what the original did."""
import copy

import pytest
import torch

from support import DEVICE, assert_close

import nnkernels.nn as nnk
from nnkernels.nn import convert


pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/conftest.py: TF32 off


class MyConv(torch.nn.Conv2d):
    """A user's subclass: its forward may differ from torch's, so convert must leave it."""


def make_model():
    torch.manual_seed(0)
    shared_bn = torch.nn.BatchNorm2d(4)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        shared_bn,
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.AvgPool2d(2), torch.nn.MaxPool2d(1)),
        torch.nn.Conv2d(4, 4, 2, padding="same"),  # asymmetric padding: left to torch
        shared_bn,
        MyConv(4, 4, 1),
        torch.nn.Conv2d(4, 4, 1).double(),
        torch.nn.ConvTranspose2d(4, 2, 2, stride=2),
        torch.nn.ConvTranspose2d(2, 2, 3, output_padding=1, dilation=2),  # output_padding >= stride
    )


def test_convert_swaps_supported_layers_in_place_sharing_parameters_and_buffers():
    model = make_model()
    originals = dict(model.named_modules())
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    keys = list(model.state_dict())
    hook_calls = []
    model[0].register_forward_hook(lambda *_: hook_calls.append(1))

    assert convert(model) is model
    assert type(model[0]) is nnk.Conv2d and type(model[1]) is nnk.BatchNorm2d
    assert type(model[3][0]) is nnk.AvgPool2d and type(model[3][1]) is torch.nn.MaxPool2d
    assert model[1] is model[5], "a layer shared by two parents stays one layer"
    assert type(model[4]) is torch.nn.Conv2d and type(model[6]) is MyConv and type(model[7]) is torch.nn.Conv2d
    assert type(model[8]) is nnk.ConvTranspose2d and type(model[9]) is torch.nn.ConvTranspose2d
    assert model[0] is not originals["0"] and model[4] is originals["4"]
    for name, p in model.named_parameters():
        assert p is params[name], name
    for name, b in model.named_buffers():
        assert b is buffers[name], name
    assert list(model.state_dict()) == keys

    summary = model.nnkernels_summary
    assert dict(summary.swapped) == {"Conv2d": 1, "ConvTranspose2d": 1, "AvgPool2d": 1, "BatchNorm2d": 1,
                                     "SyncBatchNorm": 0}
    left = {name: reason for name, _, reason in summary.left}
    assert set(left) == {"4", "6", "7", "9"}
    assert "output_padding=(1, 1)" in left["9"]
    assert "padding='same'" in left["4"] and "asymmetric" in left["4"]
    assert "MyConv" in left["6"] and "torch.float64" in left["7"]
    assert "swapped 1 Conv2d, 1 ConvTranspose2d, 1 AvgPool2d, 1 BatchNorm2d; left 4" in str(summary)

    model[0].to(DEVICE)(torch.randn(1, 2, 4, 4, device=DEVICE))
    assert hook_calls == [1], "hooks registered before convert still fire"


def test_converted_model_computes_what_the_original_did():
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
    ).to(DEVICE)
    ours = convert(copy.deepcopy(reference))
    assert all(type(m).__module__ == "nnkernels.nn" for m in list(ours)[:2])
    x = torch.randn(3, 2, 6, 6, device=DEVICE)
    assert_close(ours(x), reference(x))
    assert_close(ours[1].running_var, reference[1].running_var)


def test_convert_of_a_bare_layer_returns_its_replacement_and_is_idempotent():
    conv = torch.nn.Conv2d(2, 2, 3)
    converted = convert(conv)
    assert type(converted) is nnk.Conv2d and converted.weight is conv.weight
    again = convert(converted)
    assert again is converted and dict(again.nnkernels_summary.swapped) == {
        "Conv2d": 0, "ConvTranspose2d": 0, "AvgPool2d": 0, "BatchNorm2d": 0, "SyncBatchNorm": 0}


def test_convert_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got dict"):
        convert({})
