"""Two threads launching the same new kernel at once: both get correct results, and the kernel is
compiled once.

Compilations are counted with Triton's `knobs.runtime.jit_post_compile_hook`, which Triton calls
after each in-process compilation, keyed by the function and its cache key (constants,
specialisation, options): a key seen twice is a kernel compiled twice. The threads start their
launches together behind a barrier. On the CPU (Triton's interpreter: nothing is compiled) the
same tests check the results only.
"""
import threading
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from support import DEVICE, INTERPRETED, TOLERANCE, assert_close, poisoned, randn

from nnkernels import Conv2dForward
from nnkernels.functional.pooling import avg_pool2d
from nnkernels.functional.conv import conv2d
from nnkernels.kernel import _LAUNCHED

THREADS = 2


def together(work, threads=THREADS):
    """Run work(i) for i in range(threads) in threads released at once; return the results in order."""
    barrier = threading.Barrier(threads)
    results, errors = [None] * threads, []

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except BaseException as error:  # noqa: BLE001  (re-raised in the main thread below)
            errors.append(error)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


@contextmanager
def counting_compilations():
    """A Counter of (function name, cache key) over the compilations inside the block (empty when interpreted)."""
    compiled = Counter()
    if INTERPRETED:
        yield compiled
        return
    from triton import knobs

    lock = threading.Lock()
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, key, fn, **_):
        with lock:
            compiled[(fn.name, str(key))] += 1

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_two_threads_launch_one_new_kernel_object():
    # Constants (and launch options) no other test uses, so this process has never launched this kernel.
    constants = dict(kh=5, kw=2, stride_h=2, stride_w=1, pad_h=2, pad_w=0, g=1, block_ow=16)
    options = dict(num_warps=2, num_stages=2)
    first = Conv2dForward(**constants, **options)
    assert not any(first.hash == key[0] for key in _LAUNCHED), "precondition: the kernel must be new"
    B, C_IN, C_OUT, H, W = 1, 3, 2, 5, 7
    OH, OW = (H + 4 - 5) // 2 + 1, W - 1
    inputs = [(randn(B, C_IN, H, W), randn(C_OUT, C_IN, 5, 2)) for _ in range(THREADS)]
    outputs = [poisoned(B, C_OUT, OH, OW) for _ in range(THREADS)]

    def work(i):
        kernel = Conv2dForward(**constants, **options)  # each thread its own object: same kernel, same hash
        kernel.launch(*inputs[i], outputs[i], B, C_IN, C_OUT, H, W, OH, OW)

    with counting_compilations() as compiled:
        together(work)
    for (x, w), y in zip(inputs, outputs):
        ref = F.conv2d(x.double().cpu(), w.double().cpu(), stride=(2, 1), padding=(2, 0))
        assert_close(y, ref, tol=TOLERANCE[torch.float32])
    if not INTERPRETED:
        ours = {key: n for key, n in compiled.items() if key[0] == "conv2d_forward"}
        assert list(ours.values()) == [1], f"expected one compilation of conv2d_forward, got {ours}"


def test_two_threads_run_a_functional_op_on_a_new_shape():
    """conv2d and avg_pool2d on a shape nothing else uses (first call: kernel choice, tuning on the GPU,
    compilation) from two threads at once: right results, and no kernel compiled twice."""
    # Options no other test draws (hypothesis's dilations stop at 2, its pooling divisors at 30), so
    # every kernel here is new to the process.
    x_shape, w_shape = (2, 5, 7, 6), (7, 5, 3, 2)
    conv_options = dict(stride=(1, 2), padding=(1, 0), dilation=(1, 3))
    pool_options = ((3, 2), (2, 1), (1, 0), True, False, 31)
    inputs = [(randn(*x_shape), randn(*w_shape)) for _ in range(THREADS)]

    def work(i):
        x, w = inputs[i]
        return conv2d(x, w, **conv_options), avg_pool2d(x, *pool_options)

    with counting_compilations() as compiled:
        results = together(work)
    tf32 = not INTERPRETED and torch.backends.cudnn.allow_tf32
    for (x, w), (y, pooled) in zip(inputs, results):
        x64, w64 = x.double().cpu(), w.double().cpu()
        assert_close(y, F.conv2d(x64, w64, **conv_options), tol=2e-3 if tf32 else 1e-5)
        assert_close(pooled, F.avg_pool2d(x64, *pool_options), tol=1e-5)
    twice = {key: n for key, n in compiled.items() if n > 1}
    assert not twice, f"kernels compiled more than once: {twice}"
    if not INTERPRETED:
        assert compiled, "a new shape compiled nothing: the hook saw no compilation, so it counted nothing"
