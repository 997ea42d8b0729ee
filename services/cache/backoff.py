"""Exponential reconnect delays, reset once a connection proves healthy."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays ``initial, 2*initial, ...`` capped at ``maximum``, each with +-``jitter`` spread.

    Jitter keeps many cache replicas (or many followers of one engine) from
    reconnecting in lockstep after an engine restart.
    """

    initial: float = 0.05
    maximum: float = 2.0
    jitter: float = 0.2
    _attempt: int = field(default=0, init=False)

    def next_delay(self) -> float:
        base = min(self.maximum, self.initial * (2**self._attempt))
        # Capped so an engine that stays down for hours cannot overflow the float.
        self._attempt = min(self._attempt + 1, 32)
        return base * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)

    def reset(self) -> None:
        self._attempt = 0
