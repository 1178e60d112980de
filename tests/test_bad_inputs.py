"""Bad input at every public entry point: kernel objects (constructor and launch), functional
ops, modules and the command line. Each table row is an input tried and the error it must get;
every row also checks that nothing was written: launch outputs, running statistics and output
folders keep what they held before the call.

Each launch table starts with a valid row (id "valid"), so the errors below it come from the one
argument the row changes, not from a broken baseline.
"""
import pytest
import torch
from support import DEVICE, INTERPRETED, gpu, randn

import nnkernels.nn as nkn
from nnkernels import (Avgpool2dForward, BatchNorm2dNchwBackward, BatchNorm2dNchwForwardInference, Conv2dBackward,
                       Conv2dForward)
from nnkernels.cli import main
from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.batchnorm import batch_norm
from nnkernels.functional.conv import conv2d
from nnkernels.ops.avg_pool2d.gather import AvgPool2dGatherForward
from nnkernels.ops.batch_norm.eval import BatchNorm2dEvalForward
from nnkernels.ops.conv2d.gemm_forward import Conv2dGemmForward

SENTINEL = 7.0
OTHER_DEVICE = "meta"  # a device no launch or op accepts beside tensors on DEVICE


def sentinel(*shape, dtype=torch.float32):
    return torch.full(shape, SENTINEL, dtype=dtype, device=DEVICE)


def untouched(tensor):
    return bool((tensor == SENTINEL).all())


# ---------------------------------------------------------------- kernel constructors

def with_constant(cls, **changes):
    """An instance of `cls` with its example constants, by name, but for `changes`."""
    constants = dict(zip((c.lower() for c in cls.constant_names), cls.example_constants))
    return cls(**{**constants, **changes})


CONSTRUCTORS = [
    # (id, make, exception, message)
    ("missing-constant", lambda: Conv2dForward(3, 3, 1, 1, 1, 1, 1), TypeError, r"missing constant\(s\) block_ow"),
    ("too-many-constants", lambda: Avgpool2dForward(2, 2, 2, 2, 8, 8), TypeError, r"takes 5 constants"),
    ("unknown-constant", lambda: Avgpool2dForward(2, 2, 2, 2, 8, padding=1), TypeError, r"unknown constant 'padding'"),
    ("constant-twice", lambda: Avgpool2dForward(2, 2, 2, 2, 8, kh=2), TypeError, r"constant 'kh' given twice"),
    ("float-constant", lambda: Conv2dForward(3.0, 3, 1, 1, 1, 1, 1, 8), TypeError, r"^kh: expected an int, got 3.0"),
    ("bool-constant", lambda: Conv2dForward(True, 3, 1, 1, 1, 1, 1, 8), TypeError, r"^kh: expected an int, got True"),
    ("zero-kernel", lambda: Conv2dForward(0, 3, 1, 1, 1, 1, 1, 8), ValueError, r"^kh: expected an int >= 1, got 0"),
    ("zero-stride", lambda: Avgpool2dForward(2, 2, 0, 2, 8), ValueError, r"^stride_h: expected an int >= 1"),
    ("negative-padding", lambda: Conv2dForward(3, 3, 1, 1, -1, 1, 1, 8), ValueError, r"^pad_h: expected an int >= 0"),
    ("block-not-power-of-2", lambda: Avgpool2dForward(2, 2, 2, 2, 48), ValueError,
     r"^block_ow: expected a power of two, got 48"),
    ("int-flag", lambda: with_constant(AvgPool2dGatherForward, count_include_pad=1), TypeError,
     r"^count_include_pad: expected a bool, got 1"),
    ("float64-dtype", lambda: Avgpool2dForward(2, 2, 2, 2, 8, dtype=torch.float64), TypeError,
     r"^dtype: expected one of torch.float32, torch.float16, torch.bfloat16, got torch.float64"),
    ("int-dtype", lambda: BatchNorm2dNchwBackward(64, dtype=torch.int32), TypeError, r"^dtype: expected one of"),
    ("zero-warps", lambda: Avgpool2dForward(2, 2, 2, 2, 8, num_warps=0), ValueError,
     r"^num_warps: expected a positive int, got 0"),
]


@pytest.mark.parametrize("make, exception, message", [pytest.param(*row[1:], id=row[0]) for row in CONSTRUCTORS])
def test_kernel_constructor_refuses(make, exception, message):
    with pytest.raises(exception, match=message):
        make()


# ---------------------------------------------------------------- kernel launches

def pool_launch():
    """Avgpool2dForward(2, 2, 2, 2, 8) on x[2, 3, 6, 6] -> y[2, 3, 3, 3]."""
    kernel = Avgpool2dForward(2, 2, 2, 2, 8)
    args = dict(x=randn(2, 3, 6, 6), y=sentinel(2, 3, 3, 3), B=2, C=3, H=6, W=6, OH=3, OW=3)
    return kernel, args, ("y",)


def conv_backward_launch():
    """Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 8) on x[1, 2, 4, 4], w[3, 2, 3, 3]; outputs dx, dw (zero-initialised
    in a valid launch; here the sentinel, which a launch that runs would change)."""
    kernel = Conv2dBackward(3, 3, 1, 1, 1, 1, 1, 8)
    args = dict(dy=randn(1, 3, 4, 4), x=randn(1, 2, 4, 4), w=randn(3, 2, 3, 3), dx=sentinel(1, 2, 4, 4),
                dw=sentinel(3, 2, 3, 3), B=1, C_IN=2, C_OUT=3, H=4, W=4, OH=4, OW=4)
    return kernel, args, ("dx", "dw")


def bn_inference_launch():
    """BatchNorm2dNchwForwardInference(16) on x[2, 3, 4, 4]."""
    kernel = BatchNorm2dNchwForwardInference(16)
    args = dict(x=randn(2, 3, 4, 4), y=sentinel(2, 3, 4, 4), weight=randn(3), bias=randn(3), running_mean=randn(3),
                running_var=randn(3).abs() + 0.5, C=3, HW=16, eps=1e-5)
    return kernel, args, ("y",)


def gemm_conv_launch():
    """Conv2dGemmForward (a fast kernel: 3x3, pad 1, no bias, no TF32, 16x16x16 tiles) on x[1, 2, 4, 4]."""
    kernel = Conv2dGemmForward(kh=3, kw=3, stride_h=1, stride_w=1, pad_h=1, pad_w=1, dil_h=1, dil_w=1, g=1,
                               has_bias=False, tf32=False, block_m=16, block_n=16, block_k=16)
    y = sentinel(1, 3, 4, 4)
    args = dict(x=randn(1, 2, 4, 4), w=randn(3, 2, 3, 3), bias=y, y=y, B=1, C_IN=2, C_OUT=3, H=4, W=4, OH=4, OW=4)
    return kernel, args, ("y",)


def bn_eval_launch():
    """BatchNorm2dEvalForward(2, 16) (a fast kernel) on x[2, 3, 4, 4], one tile per channel."""
    kernel = BatchNorm2dEvalForward(block_b=2, block_hw=16)
    args = dict(x=randn(2, 3, 4, 4), y=sentinel(2, 3, 4, 4), weight=randn(3), bias=randn(3), running_mean=randn(3),
                running_var=randn(3).abs() + 0.5, B=2, C=3, HW=16, TILES_PER_CHUNK=1, eps=1e-5)
    return kernel, args, ("y",)


LAUNCHES = {"pool": pool_launch, "conv-backward": conv_backward_launch, "bn-inference": bn_inference_launch,
            "gemm-conv": gemm_conv_launch, "bn-eval": bn_eval_launch}

LAUNCH_ROWS = [
    # (launch, id, change(args) -> args, exception, message); exception None: the valid baseline
    ("pool", "valid", lambda a: a, None, None),
    ("pool", "too-few-args", lambda a: dict(list(a.items())[:-1]), TypeError,
     r"Avgpool2dForward.launch takes 8 arguments \(x, y, B, C, H, W, OH, OW\), got 7"),
    ("pool", "not-a-tensor", lambda a: {**a, "x": a["x"].tolist()}, TypeError,
     r"^x: expected a torch.Tensor of torch.float32, got list"),
    ("pool", "wrong-dtype", lambda a: {**a, "x": a["x"].half()}, TypeError,
     r"^x: expected dtype torch.float32, got torch.float16"),
    ("pool", "other-device", lambda a: {**a, "x": a["x"].to(OTHER_DEVICE)}, ValueError,
     r"^y: expected a tensor on meta like x, got "),
    ("pool", "non-contiguous-input", lambda a: {**a, "x": a["x"].transpose(2, 3)}, ValueError,
     r"^x: expected a contiguous tensor, got strides \(108, 36, 1, 6\)"),
    ("pool", "channels-last-input", lambda a: {**a, "x": a["x"].to(memory_format=torch.channels_last)}, ValueError,
     r"^x: expected a contiguous tensor"),
    ("pool", "float-size", lambda a: {**a, "H": 6.0}, TypeError, r"^H: expected an int, got float"),
    ("pool", "bool-size", lambda a: {**a, "B": True}, TypeError, r"^B: expected an int, got bool"),
    ("pool", "zero-size", lambda a: {**a, "B": 0}, ValueError, r"^B: expected an int in \[1, 2\*\*31 - 1\], got 0"),
    ("pool", "size-2**31", lambda a: {**a, "C": 2**31}, ValueError, r"^C: expected an int in \[1, 2\*\*31 - 1\]"),
    ("pool", "wrong-output-size", lambda a: {**a, "OH": 2}, ValueError, r"^OH: expected \(H \+ 2\*padding - kh\)"),
    ("pool", "kernel-larger-than-input", lambda a: {**a, "x": randn(2, 3, 1, 6), "H": 1, "OH": 1}, ValueError,
     r"^H: padded input size 1 \+ 2\*padding = 1 is smaller than kh = 2"),
    ("pool", "wrong-numel", lambda a: {**a, "x": randn(2, 3, 6, 5)}, ValueError,
     r"^x: expected B\*C\*H\*W = 216 elements, got 180"),
    ("conv-backward", "valid", lambda a: {**a, "dx": a["dx"].zero_(), "dw": a["dw"].zero_()}, None, None),
    ("conv-backward", "wrong-weight-numel", lambda a: {**a, "w": randn(3, 2, 3, 2)}, ValueError,
     r"^w: expected C_OUT\*\(C_IN/g\)\*kh\*kw = 54 elements, got 36"),
    ("conv-backward", "wrong-dw-dtype", lambda a: {**a, "dw": a["dw"].bfloat16()}, TypeError,
     r"^dw: expected dtype torch.float32, got torch.bfloat16"),
    ("conv-backward", "dy-too-small", lambda a: {**a, "dy": randn(1, 3, 4, 3)}, ValueError,
     r"^dy: expected B\*C_OUT\*OH\*OW = 48 elements, got 36"),
    ("bn-inference", "valid", lambda a: a, None, None),
    ("bn-inference", "negative-eps", lambda a: {**a, "eps": -1e-5}, ValueError, r"^eps: expected a float >= 0"),
    ("bn-inference", "nan-eps", lambda a: {**a, "eps": float("nan")}, ValueError, r"^eps: expected a float >= 0"),
    ("bn-inference", "string-eps", lambda a: {**a, "eps": "1e-5"}, TypeError, r"^eps: expected a float, got str"),
    ("bn-inference", "short-running-var", lambda a: {**a, "running_var": randn(2).abs()}, ValueError,
     r"^running_var: expected C = 3 elements, got 2"),
    ("bn-inference", "x-not-multiple-of-c-hw", lambda a: {**a, "x": randn(2, 3, 4, 3), "y": sentinel(2, 3, 4, 3)},
     ValueError, r"^x: expected a positive multiple of C\*HW = 48 elements, got 72"),
    ("gemm-conv", "valid", lambda a: a, None, None),
    ("gemm-conv", "wrong-output-size", lambda a: {**a, "OW": 3}, ValueError, r"OW"),
    ("gemm-conv", "wrong-input-numel", lambda a: {**a, "x": randn(1, 2, 4, 5)}, ValueError, r"^x: expected"),
    ("gemm-conv", "fp16-weight", lambda a: {**a, "w": a["w"].half()}, TypeError,
     r"^w: expected dtype torch.float32, got torch.float16"),
    ("bn-eval", "valid", lambda a: a, None, None),
    ("bn-eval", "running-mean-fp16", lambda a: {**a, "running_mean": a["running_mean"].half()}, TypeError,
     r"^running_mean: expected dtype torch.float32, got torch.float16"),
    ("bn-eval", "wrong-B", lambda a: {**a, "B": 3}, ValueError, r"^x: expected B\*C\*HW = 144 elements, got 96"),
]


@pytest.mark.parametrize("launch, change, exception, message",
                         [pytest.param(row[0], *row[2:], id=f"{row[0]}-{row[1]}") for row in LAUNCH_ROWS])
def test_kernel_launch_refuses_and_writes_nothing(launch, change, exception, message):
    kernel, args, outputs = LAUNCHES[launch]()
    args = change(args)
    watched = [args[name] for name in outputs if isinstance(args.get(name), torch.Tensor)]
    if exception is None:
        kernel.launch(*args.values())
        assert all(not untouched(out) and not out.isnan().any() for out in watched), "valid launch wrote nothing"
        return
    with pytest.raises(exception, match=message):
        kernel.launch(*args.values())
    for out in watched:
        if out.device.type != OTHER_DEVICE:
            assert untouched(out), "an output was written by a launch that raised"


@gpu
def test_launch_on_cpu_tensors_in_a_compiled_process_is_refused():
    kernel, args, _ = pool_launch()
    y = torch.full((2, 3, 3, 3), SENTINEL)
    cpu_args = {**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}, "y": y}
    with pytest.raises(ValueError, match=r"^x: CPU tensors need Triton's interpreter"):
        kernel.launch(*cpu_args.values())
    assert untouched(y)


# ---------------------------------------------------------------- functional ops

def assert_refuses_or_returns(op, args, exception, message, valid_shape):
    """op(*args.values()) raises `exception` matching `message`; for the valid row (`exception` None) it returns
    a tensor of `valid_shape`."""
    if exception is None:
        assert op(*args.values()).shape == valid_shape
        return
    with pytest.raises(exception, match=message):
        op(*args.values())


def conv_args(**changes):
    args = dict(x=randn(2, 6, 5, 5), weight=randn(4, 3, 3, 3), bias=randn(4), stride=1, padding=1, dilation=1,
                groups=2)
    args.update(changes)
    return args


CONV_ROWS = [
    ("valid", {}, None, None),
    ("input-not-a-tensor", dict(x=[[1.0]]), TypeError, r"^input: expected a torch.Tensor, got list"),
    ("weight-not-a-tensor", dict(weight=3.0), TypeError, r"^weight: expected a torch.Tensor, got float"),
    ("bias-not-a-tensor", dict(bias=[0.0] * 4), TypeError, r"^bias: expected a torch.Tensor or None, got list"),
    ("input-2d", dict(x=randn(6, 5)), ValueError, r"^input: expected a 3-D \(unbatched\) or 4-D"),
    ("input-5d", dict(x=randn(1, 2, 6, 5, 5)), ValueError, r"^input: expected a 3-D \(unbatched\) or 4-D"),
    ("weight-3d", dict(weight=randn(4, 3, 3)), ValueError, r"^weight: expected a 4-D tensor"),
    ("float64", dict(x=randn(2, 6, 5, 5).double(), weight=randn(4, 3, 3, 3).double(), bias=None), TypeError,
     r"^input: expected float32, float16 or bfloat16, got torch.float64"),
    ("int-input", dict(x=torch.ones(2, 6, 5, 5, dtype=torch.int32, device=DEVICE)), TypeError,
     r"^input: expected float32, float16 or bfloat16, got torch.int32"),
    ("weight-dtype-differs", dict(weight=randn(4, 3, 3, 3).half()), ValueError,
     r"^weight: expected dtype torch.float32 like input, got torch.float16"),
    ("bias-dtype-differs", dict(bias=randn(4).bfloat16()), ValueError,
     r"^bias: expected dtype torch.float32 like input"),
    ("weight-other-device", dict(weight=randn(4, 3, 3, 3).to(OTHER_DEVICE)), ValueError,
     r"^weight: expected a tensor on .* like input, got meta"),
    ("channels-mismatch", dict(x=randn(2, 5, 5, 5), groups=1), ValueError, r"^input: expected 3 channels"),
    ("groups-zero", dict(groups=0), ValueError, r"^groups: expected a positive int, got 0"),
    ("groups-float", dict(groups=2.0), ValueError, r"^groups: expected a positive int, got 2.0"),
    ("groups-not-dividing-c-out", dict(weight=randn(5, 3, 3, 3), bias=None), ValueError,
     r"^groups: 2 does not divide the weight's 5 output channels"),
    ("bias-shape", dict(bias=randn(5)), ValueError, r"^bias: expected shape \(4,\), got \(5,\)"),
    ("stride-zero", dict(stride=0), ValueError, r"^stride: expected values >= 1"),
    ("stride-string", dict(stride="2"), TypeError, r"^stride: expected an int or a pair of ints, got '2'"),
    ("stride-triple", dict(stride=(1, 2, 3)), TypeError, r"^stride: expected an int or a pair of ints"),
    ("stride-bool", dict(stride=True), TypeError, r"^stride: expected an int or a pair of ints, got True"),
    ("padding-negative", dict(padding=-1), ValueError, r"^padding: expected values >= 0"),
    ("padding-unknown-string", dict(padding="full"), ValueError, r"^padding: expected 'valid', 'same'"),
    ("padding-same-strided", dict(padding="same", stride=2), ValueError,
     r"^padding: 'same' is not supported for strided convolutions"),
    ("dilation-zero", dict(dilation=0), ValueError, r"^dilation: expected values >= 1"),
    ("kernel-larger-than-padded-input", dict(padding=0, dilation=3), ValueError,
     r"^weight: kernel height 3 \(dilated to 7\) is larger than the padded input height 5 \+ 2\*0 = 5"),
]


@pytest.mark.parametrize("changes, exception, message", [pytest.param(*row[1:], id=row[0]) for row in CONV_ROWS])
def test_conv2d_refuses(changes, exception, message):
    assert_refuses_or_returns(conv2d, conv_args(**changes), exception, message, (2, 4, 5, 5))


POOL_ROWS = [
    ("valid", {}, None, None),
    ("input-not-a-tensor", dict(x=1.0), TypeError, r"^x: expected a torch.Tensor, got float"),
    ("int-input", dict(x=torch.ones(2, 3, 6, 6, dtype=torch.int64, device=DEVICE)), TypeError,
     r"^x: expected float32, float16 or bfloat16, got torch.int64"),
    ("float64", dict(x=randn(2, 3, 6, 6).double()), TypeError, r"^x: expected float32, float16 or bfloat16"),
    ("input-2d", dict(x=randn(6, 6)), ValueError, r"^x: expected a 3-D \(C, H, W\) or 4-D"),
    ("input-5d", dict(x=randn(1, 2, 3, 6, 6)), ValueError, r"^x: expected a 3-D \(C, H, W\) or 4-D"),
    ("kernel-zero", dict(kernel_size=0), ValueError, r"^kernel_size: expected values >= 1, got 0"),
    ("kernel-string", dict(kernel_size="3"), TypeError, r"^kernel_size: expected an int or a pair of ints, got '3'"),
    ("kernel-triple", dict(kernel_size=(2, 2, 2)), TypeError, r"^kernel_size: expected an int or a pair of ints"),
    ("stride-zero", dict(stride=0), ValueError, r"^stride: expected values >= 1, got 0"),
    ("padding-over-half", dict(kernel_size=3, padding=2), ValueError,
     r"^padding: expected at most half of kernel_size \(3, 3\), got \(2, 2\)"),
    ("padding-negative", dict(padding=-1), ValueError, r"^padding: expected values >= 0"),
    ("divisor-zero", dict(divisor_override=0), ValueError,
     r"^divisor_override: expected None or a positive int, got 0"),
    ("divisor-negative", dict(divisor_override=-2), ValueError, r"^divisor_override: expected None or a positive int"),
    ("divisor-float", dict(divisor_override=2.5), ValueError, r"^divisor_override: expected None or a positive int"),
    ("kernel-larger-than-input", dict(kernel_size=7), ValueError,
     r"^x: padded input 6x6 is smaller than kernel_size \(7, 7\)"),
    ("ceil-mode-string", dict(ceil_mode="no"), TypeError, r"^ceil_mode: expected a bool"),
    ("count-include-pad-string", dict(count_include_pad="no"), TypeError, r"^count_include_pad: expected a bool"),
]


@pytest.mark.parametrize("changes, exception, message", [pytest.param(*row[1:], id=row[0]) for row in POOL_ROWS])
def test_avg_pool2d_refuses(changes, exception, message):
    """ceil_mode / count_include_pad given a string: PyTorch raises a TypeError; a truthy string read as
    True would silently pool with the other option."""
    args = dict(x=randn(2, 3, 6, 6), kernel_size=2, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None)
    args.update(changes)
    assert_refuses_or_returns(avg_pool2d, args, exception, message, (2, 3, 3, 3))


BN_ROWS = [
    ("valid-train", dict(), None, None),
    ("valid-eval", dict(training=False), None, None),
    ("input-not-a-tensor", dict(x=2.0), TypeError, r"^x: expected a torch.Tensor, got float"),
    ("input-1d", dict(x=randn(3)), ValueError, r"^x: expected at least 2 dimensions \(B, C, ...\), got shape \(3,\)"),
    ("float64", dict(x=randn(2, 3, 4, 4).double()), TypeError, r"^x: expected float32, float16 or bfloat16"),
    ("weight-shape", dict(weight=randn(4)), ValueError, r"^weight: expected shape \(3,\) for the 3 channels of x"),
    ("weight-int", dict(weight=torch.ones(3, dtype=torch.int32, device=DEVICE)), TypeError,
     r"^weight: expected None or a float tensor"),
    ("bias-other-device", dict(bias=randn(3).to(OTHER_DEVICE)), ValueError,
     r"^bias: expected a tensor on .* like x, got meta"),
    ("only-running-mean", dict(running_var=None), ValueError, r"^running_mean, running_var: expected both or neither"),
    ("eval-without-statistics", dict(running_mean=None, running_var=None, training=False), ValueError,
     r"^running_mean: expected a tensor in evaluation mode"),
    ("running-var-fp16", dict(running_var=torch.ones(3, dtype=torch.float16, device=DEVICE)), ValueError,
     r"^running_var: expected a float32 tensor"),
    ("running-var-short", dict(running_var=torch.ones(2, device=DEVICE)), ValueError,
     r"^running_var: expected a float32 tensor of shape \(3,\), got \(2,\)"),
    ("running-mean-strided", dict(running_mean=torch.zeros(6, device=DEVICE)[::2]), ValueError,
     r"^running_mean: expected a contiguous tensor \(the kernels update it in place\), got strides \(2,\)"),
    ("momentum-none", dict(momentum=None), TypeError, r"^momentum: expected a float; for a cumulative average"),
    ("momentum-string", dict(momentum="0.1"), TypeError, r"^momentum: expected a float, got '0.1'"),
    ("eps-negative", dict(eps=-1.0), ValueError, r"^eps: expected a float >= 0, got -1.0"),
    ("eps-nan", dict(eps=float("nan")), ValueError, r"^eps: expected a float >= 0, got nan"),
    ("one-value-per-channel", dict(x=randn(1, 3, 1, 1)), ValueError, r"^x: Expected more than 1 value per channel"),
    ("training-string", dict(training="no"), TypeError, r"^training: expected a bool"),
]


@pytest.mark.parametrize("changes, exception, message", [pytest.param(*row[1:], id=row[0]) for row in BN_ROWS])
def test_batch_norm_refuses_and_leaves_running_statistics(changes, exception, message):
    """training given a string: PyTorch raises a TypeError; "no" read as True would silently train."""
    running_mean, running_var = sentinel(3), sentinel(3)
    args = dict(x=randn(2, 3, 4, 4), running_mean=running_mean, running_var=running_var, weight=randn(3),
                bias=randn(3), training=True, momentum=0.1, eps=1e-5)
    args.update(changes)
    if exception is None:
        assert batch_norm(*args.values()).shape == (2, 3, 4, 4)
        assert untouched(running_mean) != args["training"], "training updates the statistics, eval leaves them"
        return
    with pytest.raises(exception, match=message):
        batch_norm(*args.values())
    assert untouched(running_mean) and untouched(running_var), "running statistics written by a call that raised"


# ---------------------------------------------------------------- modules

MODULE_ROWS = [
    # (id, make layer, input, exception, message)
    ("conv-same-asymmetric", lambda: nkn.Conv2d(3, 4, 2, padding="same"), None, NotImplementedError,
     r"padding='same' with kernel_size=\(2, 2\)"),
    ("conv-channels", lambda: nkn.Conv2d(3, 4, 3), lambda: randn(2, 5, 6, 6), RuntimeError,
     r"^Conv2d: input: expected 3 channels"),
    ("conv-2d-input", lambda: nkn.Conv2d(3, 4, 3), lambda: randn(3, 6), RuntimeError,
     r"^Conv2d: input: expected a 3-D \(C, H, W\) or 4-D"),
    ("conv-float64", lambda: nkn.Conv2d(3, 4, 3), lambda: randn(2, 3, 6, 6).double(), NotImplementedError,
     r"^Conv2d: input: dtype torch.float64 is not supported"),
    ("conv-dtype-differs", lambda: nkn.Conv2d(3, 4, 3), lambda: randn(2, 3, 6, 6).half(), RuntimeError,
     r"^Conv2d: input: expected dtype torch.float32 like weight, got torch.float16"),
    ("conv-not-a-tensor", lambda: nkn.Conv2d(3, 4, 3), lambda: [1.0], TypeError,
     r"^Conv2d: input: expected a torch.Tensor, got list"),
    ("pool-int-input", lambda: nkn.AvgPool2d(2), lambda: torch.ones(2, 3, 4, 4, dtype=torch.int64, device=DEVICE),
     NotImplementedError, r"^AvgPool2d: input: dtype torch.int64 is not supported"),
    ("pool-5d-input", lambda: nkn.AvgPool2d(2), lambda: randn(1, 2, 3, 4, 4), RuntimeError,
     r"^AvgPool2d: input: expected a 3-D"),
    ("bn-3d-input", lambda: nkn.BatchNorm2d(3), lambda: randn(3, 4, 4), ValueError,
     r"^BatchNorm2d: expected 4D input \(got 3D input\)"),
    ("bn-channels", lambda: nkn.BatchNorm2d(3), lambda: randn(2, 4, 4, 4), RuntimeError,
     r"^BatchNorm2d: input: expected 3 channels \(dim 1\) like weight"),
    ("bn-one-value-per-channel", lambda: nkn.BatchNorm2d(3), lambda: randn(1, 3, 1, 1), ValueError,
     r"Expected more than 1 value per channel"),
]


@pytest.mark.parametrize("make, make_input, exception, message",
                         [pytest.param(*row[1:], id=row[0]) for row in MODULE_ROWS])
def test_module_refuses(make, make_input, exception, message):
    if make_input is None:
        with pytest.raises(exception, match=message):
            make()
        return
    layer = make().to(DEVICE)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(exception, match=message):
        layer(make_input())
    for name, value in layer.state_dict().items():
        if name != "num_batches_tracked":  # counted before the check, as torch.nn.BatchNorm2d counts it
            assert torch.equal(value, state[name]), f"{name} written by a call that raised"


def test_batch_norm_module_counts_a_refused_batch_like_torch():
    """torch.nn.BatchNorm2d adds 1 to num_batches_tracked before F.batch_norm refuses the input; ours does the
    same, so both count alike (and nothing else is written)."""
    ours, theirs = nkn.BatchNorm2d(3).to(DEVICE), torch.nn.BatchNorm2d(3).to(DEVICE)
    x = randn(1, 3, 1, 1)
    for layer in (ours, theirs):
        with pytest.raises(ValueError):
            layer(x)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked)


# ---------------------------------------------------------------- command line

CLI_ROWS = [
    # (id, arguments (OUT = the output folder), exit code, message in stderr)
    ("unknown-target", ["compile", "--target", "sm_75", "--out", "OUT"], 2, "Invalid value for --target"),
    ("unknown-kernel", ["compile", "NoSuchKernel", "--out", "OUT"], 2, "unknown kernel(s) NoSuchKernel"),
    ("unknown-dtype", ["compile", "--dtype", "fp64", "--out", "OUT"], 2, "Invalid value for '--dtype'"),
    ("unknown-bench-suite", ["bench", "no_such_op", "--out", "OUT"], 2, "unknown suite(s) no_such_op"),
    ("demo-zero-epochs", ["demo", "--epochs", "0", "--out", "OUT"], 2, "Invalid value for '--epochs'"),
    ("demo-batch-size-1", ["demo", "--batch-size", "1", "--out", "OUT"], 2, "Invalid value for '--batch-size'"),
    ("demo-unknown-device", ["demo", "--device", "tpu", "--out", "OUT"], 2, "Invalid value for '--device'"),
]


def run_cli(capsys, args):
    with pytest.raises(SystemExit) as exited:
        main(args)
    return exited.value.code, capsys.readouterr()


@pytest.mark.parametrize("args, code, message", [pytest.param(*row[1:], id=row[0]) for row in CLI_ROWS])
def test_cli_refuses_and_creates_no_output(capsys, tmp_path, args, code, message):
    out = tmp_path / "out"
    got, captured = run_cli(capsys, [str(out) if a == "OUT" else a for a in args])
    assert got == code
    assert message in captured.err
    assert not out.exists(), "output folder created by a command that failed"


def test_cli_compile_out_is_a_file(capsys, tmp_path):
    target = tmp_path / "manifest"
    target.write_text("keep")
    got, captured = run_cli(capsys, ["compile", "--out", str(target), "Avgpool2dForward"])
    assert got == 2 and "is a file" in captured.err
    assert target.read_text() == "keep"


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU machine `bench` is valid and runs the benchmarks")
def test_cli_bench_without_gpu_fails_in_one_line(capsys, tmp_path):
    out = tmp_path / "bench"
    got, captured = run_cli(capsys, ["bench", "--out", str(out)])
    assert got == 1
    assert captured.err.startswith("nnkernels: error: ") and captured.err.count("\n") == 1
    assert not out.exists()


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU machine --device cuda is valid")
def test_cli_demo_on_cuda_without_gpu_is_refused(capsys, tmp_path):
    out = tmp_path / "demo"
    got, captured = run_cli(capsys, ["demo", "--device", "cuda", "--out", str(out)])
    assert got == 2 and "no CUDA device here" in captured.err
    assert not out.exists()

