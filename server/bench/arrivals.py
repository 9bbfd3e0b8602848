"""Inter-arrival gaps for open-loop load, as in `vllm bench serve`.

Gaps are gamma distributed with shape `burstiness` and scale `1 / (rate * burstiness)`, so the mean
gap is always `1 / rate`: burstiness 1 is a Poisson process (exponential gaps), below 1 is
burstier, above 1 is more regular. A rate of `inf` sends everything at once (all gaps 0). The
sequence depends only on (rate, burstiness, seed), so a run is reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def check_arrival_params(rate: float, burstiness: float) -> None:
    """Raise ValueError with a hint when the rate or burstiness is unusable."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0 (1 = Poisson), got {burstiness}")


def inter_arrival_gaps(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """An endless, seeded stream of gaps in seconds between consecutive request arrivals."""
    check_arrival_params(rate, burstiness)
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_times(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first `n` arrival times (seconds from the start): cumulative sums of the gaps."""
    times, t = [], 0.0
    gaps = inter_arrival_gaps(rate, burstiness, seed)
    for _ in range(n):
        t += next(gaps)
        times.append(t)
    return times
