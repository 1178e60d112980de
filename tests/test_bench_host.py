"""`nnkernels bench host`'s harness: the timing loop, and every case runs both sides' forward and backward (on the
GPU where there is one, which the benchmark times)."""
import torch

from nnkernels.bench import host
from support import DEVICE


def test_host_ms_times_back_to_back_calls_and_synchronises_once_a_round(monkeypatch):
    clock, calls, synchronised = [0.0], [], []
    monkeypatch.setattr(host.time, "perf_counter", lambda: clock[0])

    def call():
        calls.append(1)
        clock[0] += 0.002  # 2 ms a call

    assert abs(host.host_ms(call, lambda: synchronised.append(1), calls=10, rounds=3, warmup=4) - 2.0) < 1e-9
    assert len(calls) == 4 + 3 * 10 and len(synchronised) == 1 + 3


def test_every_case_runs_forward_and_backward_on_both_sides():
    for name, sides in host.cases(DEVICE, torch.float32).items():
        for side in sides:
            side()  # each computes its gradients; a broken case raises
    assert set(host.cases(DEVICE, torch.float32)) >= {"conv2d 3x3 64->64", "conv2d 1x1 64->256", "batch_norm train",
                                                      "batch_norm eval", "avg_pool2d 3x3 s2 p1"}
