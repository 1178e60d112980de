"""The convolution's algorithms, listed once per pass (see `base` for what an algorithm is and how a tier's
candidates are merged).

`forward_pass(p)`, `dx_pass(p)` and `dw_pass(p)` say, for problem p, which tuning kind and key a pass is chosen
under, on which problem its runners run, and its candidates. Choosing (`choose`), naming the kernels a call
uses (`peek` then `kernels`), pre-compiling and running are walks over these lists. A stride-1 dx that a
channels-last forward can compute (`Problem.dx_forward`) is that forward: its pass is the forward pass of the
transposed problem, and shares its tuning. On a channels-last problem (`Problem.nhwc`) an algorithm that reads
NCHW runs `through_nchw`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ... import tuning
from . import channels_last, depthwise, depthwise_cl, implicit_gemm, pointwise, rows, tma, unfolded, winograd
from .base import Choice, algorithm_named, decode_choice, tier_choices
from .through_nchw import copy_kernels, through_nchw

# A channels-last depthwise layer's own kernels share a tier with the NCHW ones (through layout copies): tuning
# times both.
# A 1x1 layer's NCHW products share a tier with the channels-last kernels (through layout copies): the copies cost
# a memory pass, the NCHW products run short on small planes; tuning times both (the pointwise `ranks`).
FORWARD = [(depthwise_cl.FORWARD, depthwise.FORWARD),
           (pointwise.FORWARD, channels_last.FORWARD, tma.FORWARD, winograd.FORWARD), (rows.FORWARD,),
           (implicit_gemm.FORWARD,)]
DX = [(depthwise_cl.DX, depthwise.DX), (pointwise.DX, channels_last.DX, tma.DX), (unfolded.DX,), (channels_last.DX,),
      (implicit_gemm.DX,)]
DW = [(depthwise_cl.DW, depthwise.DW), (unfolded.DW, winograd.DW), (pointwise.DW, tma.DW, channels_last.DW),
      (implicit_gemm.DW,)]


@dataclass(frozen=True)
class Pass:
    """One pass of a convolution: chosen under tuning's `kind` and `key`, run on `problem`."""

    kind: str
    key: tuple
    problem: object
    candidates: Callable[[], list]

    def choose(self, run) -> Choice:
        """The choice tuning makes (timing `run(choice)` where it must)."""
        return tuning.choose(self.kind, self.key, self.candidates, run, decode_choice)

    def peek(self) -> Choice:
        """The choice a call would make now, timing nothing."""
        return tuning.peek(self.kind, self.key, self.candidates(), decode_choice)

    def remembered(self) -> Choice | None:
        """The choice tuning remembers for this pass (cache or shipped table), or None."""
        return tuning.remembered(self.kind, self.key, self.candidates(), decode_choice)

    def kernels(self, choice: Choice) -> list:
        algorithm = algorithm_named(choice.algorithm)
        kernels = algorithm.kernels(self.problem, choice.config)
        if self.problem.nhwc and not algorithm.channels_last_input:
            before, after = copy_kernels(self.problem, self.kind)
            return before + kernels + after
        return kernels

    def runner(self, choice: Choice):
        algorithm = algorithm_named(choice.algorithm)
        run = algorithm.runner(self.problem, choice.config)
        if self.problem.nhwc and not algorithm.channels_last_input:
            return through_nchw(self.problem, self.kind, run)
        return run

    def reads_channels_last(self, choice: Choice) -> bool:
        """Whether the runner takes a channels-last copy of dy (and x) that a backward may make once for dx and
        dw; a channels-last problem's runners read the tensors themselves."""
        return algorithm_named(choice.algorithm).channels_last_input and not self.problem.nhwc


def forward_pass(p) -> Pass:
    return Pass("conv2d_forward", p.key, p, lambda: _listed(FORWARD, p))


def dx_pass(p) -> Pass:
    transposed = p.dx_forward()
    if transposed is not None:
        return forward_pass(transposed)
    return Pass("conv2d_dx", p.key, p, lambda: _listed(DX, p))


def dw_pass(p) -> Pass:
    return Pass("conv2d_dw", p.key, p, lambda: _listed(DW, p))


def _listed(tiers, p):
    """The pass's candidates; the interpreter gets one, as few large programs are what runs fast there."""
    choices = tier_choices(tiers, p)
    return choices if p.machine.gpu else choices[:1]
