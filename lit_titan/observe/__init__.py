"""Seeing inside a run: step phases, hang dumps, and the run report (``lit-titan report``)."""

from lit_titan.observe.phases import PHASES, PhaseClock, StepTimes, phase

__all__ = ["PHASES", "PhaseClock", "StepTimes", "phase"]
