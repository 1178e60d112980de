"""`nnkernels tune MODEL`: a module:function model built, converted and warmed up, warmup's summary printed; a
MODEL that does not resolve is bad usage naming it."""
import sys

import pytest
import torch

from nnkernels.cli import main


def two_convs():
    """The model the tests tune: two convolutions, a batch norm and a pooling, small enough for the interpreter."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.AvgPool2d(2))


def not_a_model():
    return "resnet"


def nnkernels(capsys, *args):
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("channels_last", [False, True])
def test_tune_warms_up_a_module_function_model(capsys, channels_last):
    args = ["tune", f"{__name__}:two_convs", "--batch-size", "2", "--image-size", "8", "--dtype", "fp32"]
    code, out, err = nnkernels(capsys, *args, *(["--channels-last"] if channels_last else []))
    assert code == 0, err
    assert "swapped 2 Conv2d, 1 AvgPool2d, 1 BatchNorm2d" in out
    assert "nnkernels.warmup: 4 nnkernels layers, forward and backward" in out
    assert "\n\n" not in out  # no trace of the progress bar where the output is not a terminal


@pytest.mark.parametrize("model, says", [
    (f"{__name__}:not_a_model", "returned a str, not a torch.nn.Module"),
    (f"{__name__}:no_such_function", "cannot import it"),
    ("not_a_torchvision_model", "not_a_torchvision_model"),
])
def test_a_model_that_does_not_resolve_is_bad_usage(capsys, model, says):
    code, out, err = nnkernels(capsys, "tune", model)
    assert code == 2 and "MODEL" in err and says in err and model in err
    assert out == ""


def test_without_torchvision_a_model_name_says_so(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    code, _, err = nnkernels(capsys, "tune", "resnet18")
    assert code == 2 and "resnet18" in err and "needs torchvision" in err
