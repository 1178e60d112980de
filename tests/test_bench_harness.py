"""The memory-bound benches' bandwidth columns: the floor at the copy ceiling, and the share of the
bandwidth of a copy of the same bytes (timed on the GPU; a stand-in time here)."""
from nnkernels.bench import harness


def test_bandwidth_columns_judge_a_pass_by_the_peak_and_by_a_same_size_copy(monkeypatch):
    timed = []
    monkeypatch.setattr(harness, "copy_ms", lambda nbytes: timed.append(nbytes) or 1.5)
    columns = harness.bandwidth_columns(int(4.27e9), ours_ms=2.0)
    assert timed == [int(4.27e9)]  # the copy moves the pass's bytes
    assert columns == {"floor_ms": "1.0000", "of_peak": "50%", "copy_ms": "1.5000", "of_copy": "75%"}
