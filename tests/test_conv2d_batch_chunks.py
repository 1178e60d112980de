"""conv2d splits a batch whose pixels overflow the kernels' int32 pixel index into slices.

The real case needs more than 2**31 pixels (tests/test_large_tensors.py, on the GPU); here the
limit is lowered so that a small batch takes the same path on any machine.
"""
import importlib

import torch
import torch.nn.functional as F
from support import assert_close, randn

conv2d_module = importlib.import_module("nnkernels.functional.conv")


def test_a_batch_split_into_slices_gives_torchs_values_and_gradients(monkeypatch):
    monkeypatch.setattr(conv2d_module, "PIXEL_INDEX_LIMIT", 2 * 6 * 6 + 1)  # two 6x6 images per slice
    x = randn(5, 3, 6, 6).requires_grad_()
    w, b = randn(4, 3, 3, 3).requires_grad_(), randn(4).requires_grad_()
    assert len(conv2d_module._batch_chunks(5, 6 * 6)) == 3
    y = conv2d_module.conv2d(x, w, b, padding=1)
    dy = randn(*y.shape)
    y.backward(dy)
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, w, b))
    y64 = F.conv2d(x64, w64, b64, padding=1)
    y64.backward(dy.cpu().double())
    tol = 1e-5 if not torch.backends.cudnn.allow_tf32 or x.device.type == "cpu" else 3e-3
    for ours, ref in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert_close(ours, ref, tol=tol)
