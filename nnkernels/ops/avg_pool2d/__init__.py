"""The average-pooling kernels: the seed kernels, the gather, lanes and channels-last kernels."""
