"""A manual clock for code that takes ``clock: Callable[[], float]``."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Returns ``now`` until a test moves it with ``advance``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self.now += seconds
