"""Benchmark suites: one module per functional op, each with `run(quick) -> list[Row]`.

`nnkernels bench OP` imports `nnkernels.bench.<OP>`; the suites share `harness`.
"""
SUITES = ("conv2d", "avg_pool2d", "batch_norm")
