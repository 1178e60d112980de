"""`side_by_side(device, main_work, side_work)`: two independent pieces of an op's work, at once while a CUDA
graph is being captured (the second on a side stream forked from the current stream and joined back to it),
one after the other otherwise.

A convolution's backward is two independent products, dx and dw (with its ordered reduce). Several of
them leave the GPU partly idle (memory-bound 1x1 products at a quarter of the copy rate, grids whose
last wave fills few SMs), so running dw beside dx overlaps the two; the kernels and their results are
the same, bit for bit. In a CUDA graph that shortened the backward of most layers tried (docs/notes.md,
"dw beside dx on a side stream").

Outside a capture the fork is not worth its host time: its Python and stream calls add to every backward,
and an eager convolution's host time exceeds its GPU time, so the GPU has nothing to overlap; one after
the other was faster at every size tried (docs/notes.md, same section).

Ordering is that of one stream: the side stream waits for everything queued on the current stream
before the fork, and the current stream waits for the side stream before anything queued after the
join, so callers, CUDA-graph capture (the fork and the join are captured as graph edges) and
`torch.compile` see one stream. Tensors the side work returns were allocated on the side stream and
are recorded on the current one, so the caching allocator does not hand their memory out again
before the current stream is done with them.
"""
import threading

import torch

_side_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU, made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(device=index)
        return _side_streams[index]


def side_by_side(device: torch.device, main_work, side_work):
    """(main_work(), side_work()): while a CUDA graph is being captured on `device`, side_work's kernels on the
    side stream and main_work's on the current stream, both after the current stream's earlier work and
    before its later work (`forked`); otherwise one after the other. side_work returns a tuple of tensors."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return main_work(), side_work()
    return forked(device, main_work, side_work)


def forked(device: torch.device, main_work, side_work):
    """(main_work(), side_work()) with side_work's kernels on `device`'s side stream, forked from the current
    stream and joined back to it; side_work returns a tuple of tensors (or Nones)."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_result = side_work()
    main_result = main_work()
    main.wait_stream(side)
    for tensor in side_result:
        if tensor is not None:
            tensor.record_stream(main)
    return main_result, side_result
