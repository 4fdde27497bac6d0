"""The training loader, reading the next optimizer step's batches before the current step trains.

Why: when the data store goes away, the rank that cannot read must still reach the step boundary,
where every rank agrees to save and stop (``lit_titan/callbacks/preemption.py``). A failed read
met at the start of a step would leave that rank outside the step's collectives while its peers
wait inside them. Read ahead, the failure is met while the current step's batches are in hand: the
step trains, and the boundary sees the stop request. Costs ``accumulation`` micro-batches of token
ids held in memory; with loader workers, the batches were already read ahead by them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from lit_titan.data.remote import DataStoreUnavailable


class StepAheadLoader(DataLoader):
    """A DataLoader whose iterator holds the next optimizer step's micro-batches (``accumulation``)."""

    accumulation = 1  # micro-batches per optimizer step, set on the instance by the data module

    def __iter__(self) -> Iterator[Any]:
        return _StepAhead(super().__iter__(), max(1, int(self.accumulation)))


class _StepAhead:
    def __init__(self, batches: Iterator[Any], accumulation: int) -> None:
        self._batches, self._accumulation = batches, accumulation
        self._ahead: deque = deque()
        self._served = 0
        self._failed = False

    def __iter__(self) -> _StepAhead:
        return self

    def __next__(self) -> Any:
        if not self._ahead:
            self._ahead.append(next(self._batches))  # nothing in hand: a failure here is raised
        batch = self._ahead.popleft()
        self._served += 1
        if self._served % self._accumulation == 0 and not self._failed:  # the last of its step
            try:
                for _ in range(self._accumulation):
                    self._ahead.append(next(self._batches))
            except StopIteration:
                pass
            except DataStoreUnavailable as err:
                from lit_titan.callbacks.preemption import request_stop

                self._failed = True
                request_stop(f"data store outage: {_reason(err)}")
        return batch

    def __getattr__(self, name: str) -> Any:  # the wrapped iterator's own attributes (workers, ...)
        return getattr(self._batches, name)


def _reason(err: BaseException) -> str:
    """The error's own message; raised in a loader worker, torch re-raises it with the worker's traceback."""
    text = str(err)
    if "Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(f"{DataStoreUnavailable.__name__}: ", 1)[-1]
    return text.strip()
