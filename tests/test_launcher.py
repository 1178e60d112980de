"""`Launcher`: a plan's launches go straight to Triton's compiled launcher after the first, checked one, unless a
launch hook (a profiler's) is set; in the interpreter every launch is checked."""
import pytest
import torch
from triton import knobs

from nnkernels import launcher
from nnkernels.launcher import Launcher, launch_hooked
from nnkernels.ops.common.layout import channels_last_kernel, channels_last_tiles
from support import DEVICE, INTERPRETED, randn


def _hook(*args, **kwargs):
    pass


def test_launch_hooked_reads_triton_3_6_and_later_hooks(monkeypatch):
    chain_type = type(knobs.runtime.launch_enter_hook)
    if hasattr(knobs.runtime.launch_enter_hook, "calls"):  # a HookChain: empty means no hook
        chain = chain_type()
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
        assert not launch_hooked()
        chain.add(_hook)
        assert launch_hooked()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not launch_hooked()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _hook)
    assert launch_hooked()


def _copy_case():
    kernel = channels_last_kernel(16, 20, torch.float32)
    x = randn(3, 16, 4, 5)
    return kernel, x, (3, 16, 20)


def test_every_launch_computes_what_the_first_did():
    kernel, x, sizes = _copy_case()
    launch = Launcher(kernel)
    for _ in range(3):
        y = torch.full((3, 4, 5, 16), float("nan"), device=DEVICE)
        launch(x, y, *sizes)
        assert torch.equal(y, x.permute(0, 2, 3, 1))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter checks every launch")
def test_later_launches_skip_the_checks_unless_a_hook_is_set(monkeypatch):
    kernel, x, sizes = _copy_case()
    launch = Launcher(kernel)
    y = torch.empty(3, 4, 5, 16, device=DEVICE)
    launch(x, y, *sizes)
    checked = []
    original = type(kernel).checked_launch
    monkeypatch.setattr(type(kernel), "checked_launch", lambda self, args: checked.append(1) or original(self, args))
    y.zero_()
    launch(x, y, *sizes)
    torch.cuda.synchronize()
    assert not checked and torch.equal(y, x.permute(0, 2, 3, 1))
    monkeypatch.setattr(launcher, "launch_hooked", lambda: True)
    launch(x, y, *sizes)
    assert checked == [1]
