"""`remat.choose` over made-up peaks (and schedules): what it chose and what it compiled, in order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from farskip_jax.train import remat


def choose_with_peaks(candidates: Sequence[str], peaks: dict[str, float], budget: float = 10,
                      schedule: Callable[[str], Any] | None = None) -> tuple[Any, list[str]]:
    """Each candidate "compiles" to itself with its peak from ``peaks``; every fit is agreed to."""
    compiled: list[str] = []

    def compile_peak(candidate: str) -> tuple[str, float]:
        compiled.append(candidate)
        return candidate, peaks[candidate]

    choice = remat.choose(candidates, compile_peak, budget=budget, agree=lambda ok: ok, schedule=schedule)
    return choice, compiled
