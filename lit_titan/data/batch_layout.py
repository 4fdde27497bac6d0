"""How a global batch splits into data-parallel ranks, micro-batches and gradient accumulation.

The one place where "micro = data.micro_batch_size or global_batch // dp" is worked out: the config's
``JobSpec``, the data module, the strategy's trainer setup and the planner all read a ``BatchLayout``,
so a change to the rule (or to its error line) cannot leave one of them behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_titan.errors import ConfigError


@dataclass(frozen=True)
class BatchLayout:
    """Sequences per optimizer step (``global_batch``), per rank per forward (``micro``), and the
    Lightning micro-batches per step on each data-parallel rank (``accumulation``)."""

    global_batch: int
    micro: int
    accumulation: int
    dp: int

    @property
    def local(self) -> int:
        """Sequences per data-parallel rank per optimizer step."""
        return self.micro * self.accumulation

    @classmethod
    def derive(cls, global_batch: int, micro_batch_size: int | None, dp: int, *, check: bool = True) -> BatchLayout:
        """The layout of ``global_batch`` sequences over ``dp`` data-parallel ranks.

        ``micro_batch_size`` None: one micro-batch per rank per step (no accumulation). ``check=False``
        (the planner, which reports a bad split as one reason among others and still estimates the
        rest) rounds instead of refusing: at least one sequence and one micro-batch.
        """
        global_batch, dp = int(global_batch), int(dp)
        micro = int(micro_batch_size) if micro_batch_size is not None else global_batch // dp
        if check and (micro < 1 or global_batch % (dp * micro)):
            raise ConfigError(
                f"data.global_batch_size={global_batch}: not divisible by data-parallel size {dp} x micro-batch "
                f"{micro}; use a multiple of {dp * max(micro, 1)} or change data.micro_batch_size"
            )
        micro = max(micro, 1)
        return cls(global_batch=global_batch, micro=micro, accumulation=max(global_batch // (dp * micro), 1), dp=dp)
