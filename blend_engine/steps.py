"""Stepped jobs: long model work cut into units (a layer of a prefill, one chunk cached), so the engine
loop can run one unit between two steps of the batch and a request waits for a unit, never a job.

A stepped job is a generator: it yields between units and returns its result (`Steps[T]`).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]  # a stepped job: yields between units, returns its result


def drain(steps: Steps[T]) -> T:
    """Run a stepped job to its end on this thread."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
