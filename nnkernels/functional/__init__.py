"""Torch-facing ops: checks, choice of kernel, autograd, registered with torch.library.

One module per op (conv2d, avg_pool2d, batch_norm); this package re-exports them.
"""
