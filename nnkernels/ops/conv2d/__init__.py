"""The convolution kernels: the seed kernels, implicit GEMMs (NCHW, channels-last, TMA boxes), 1x1 products,
depthwise, row-wise, Winograd, and the layout helpers only convolution uses."""
