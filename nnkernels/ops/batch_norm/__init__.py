"""The batch-norm kernels: the seed kernels, the training passes and the evaluation passes."""
