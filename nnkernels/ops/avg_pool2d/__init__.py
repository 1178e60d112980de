"""The average-pooling kernels: the seed kernels, the gather kernels and the lanes kernels."""
