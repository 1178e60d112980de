"""An algorithm that reads and writes NCHW, run on a channels-last problem (`Problem.nhwc`): its tensor inputs
copied to NCHW by the tile transpose first, its output (y or dx) copied back to channels-last after; dw is the
weight's own layout and stays. The channels-last algorithms (`Algorithm.channels_last_input`) need none of it."""
from __future__ import annotations

from ..layout import channels_first_copy, channels_first_copy_kernels, channels_last_copy_kernels, channels_last_result


def _nhwc(shape):
    n, c, h, w = shape
    return (n, h, w, c)


def _to_nchw(p, shape):
    copy = channels_first_copy(_nhwc(shape), p.dtype, p.device)
    return lambda t: copy(t.permute(0, 2, 3, 1))


def _to_channels_last(p, shape):
    return channels_last_result(shape, p.dtype, p.device)


def copy_kernels(p, kind: str) -> tuple[list, list]:
    """(the copies before, the copies after) the kernels of pass `kind` ("conv2d_forward", "conv2d_dx" or
    "conv2d_dw")."""
    def to_nchw(shape):
        return channels_first_copy_kernels(_nhwc(shape), p.dtype)

    if kind == "conv2d_forward":
        return to_nchw(p.x_shape), channels_last_copy_kernels(p.y_shape, p.dtype)
    if kind == "conv2d_dx":
        return to_nchw(p.y_shape), channels_last_copy_kernels(p.x_shape, p.dtype)
    return to_nchw(p.y_shape) + to_nchw(p.x_shape), []


def through_nchw(p, kind: str, run):
    """The runner `run` of pass `kind` on p's channels-last tensors, as `copy_kernels` lists its copies."""
    if kind == "conv2d_forward":
        x_in, y_out = _to_nchw(p, p.x_shape), _to_channels_last(p, p.y_shape)
        return lambda x, weight, bias: y_out(run(x_in(x), weight, bias))
    dy_in, x_in = _to_nchw(p, p.y_shape), _to_nchw(p, p.x_shape)
    if kind == "conv2d_dx":
        dx_out = _to_channels_last(p, p.x_shape)
        return lambda dy, weight, dy_cl: dx_out(run(dy_in(dy), weight, None))
    return lambda dy, x, copies: run(dy_in(dy), x_in(x), None)
