"""The launch checks every convolution kernel shares: sizes against the constants and the tensors."""
from ..common.checks import check_numel


def check_conv_launch(k, a, groups, weight=True):
    """Check the sizes of a convolution launch (with dilation) against its tensors (the weight `w` too, unless not
    `weight`: a layout of the kernel's own, checked by it); return C_IN/G, C_OUT/G."""
    if a.C_IN % groups:
        raise ValueError(f"C_IN: expected a multiple of the {groups} groups, got {a.C_IN}")
    if a.C_OUT % groups:
        raise ValueError(f"C_OUT: expected a multiple of the {groups} groups, got {a.C_OUT}")
    for out_name, got, size_name, size, kernel, stride, pad, dil in (
        ("OH", a.OH, "H", a.H, k.kh, k.stride_h, k.pad_h, k.dil_h),
        ("OW", a.OW, "W", a.W, k.kw, k.stride_w, k.pad_w, k.dil_w),
    ):
        span = dil * (kernel - 1) + 1
        expected = (size + 2 * pad - span) // stride + 1
        if size + 2 * pad < span or got != expected:
            raise ValueError(
                f"{out_name}: expected ({size_name} + 2*pad - dil*(k-1) - 1) // stride + 1 = {expected} "
                f"(>= 1), got {got}"
            )
    x_numel = a.B * a.C_IN * a.H * a.W
    w_numel = a.C_OUT * (a.C_IN // groups) * k.kh * k.kw
    y_numel = a.B * a.C_OUT * a.OH * a.OW
    for names, numel, formula in (
        (("x", "dx"), x_numel, "B*C_IN*H*W"),
        (("w",) if weight else (), w_numel, "C_OUT*(C_IN/G)*KH*KW"),
        (("y", "dy"), y_numel, "B*C_OUT*OH*OW"),
    ):
        for name in names:
            if hasattr(a, name):
                check_numel(name, getattr(a, name), numel, formula)
    return a.C_IN // groups, a.C_OUT // groups
