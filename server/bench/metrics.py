"""Benchmark statistics computed from per-request records, the way vLLM and SGLang define them.

Definitions (all measured on the client, latencies reported in milliseconds):
- TTFT: send -> first content chunk (a chunk whose text is non-empty; role-only chunks don't count).
- ITL: every gap between consecutive content chunks, pooled over all successful requests.
- TPOT: per request (e2e - ttft) / (output_tokens - 1), only for requests with >= 2 output tokens.
- E2EL: send -> end of stream.
- Throughput: successful requests and their output tokens divided by the level's wall time;
  achieved concurrency is the sum of successful requests' E2EL over the wall time (as SGLang).
- Goodput: successful requests meeting every given SLO, per second. A request with fewer than two
  output tokens has no TPOT and is judged on the other SLOs only (as vLLM does).
Only successful requests enter the latency statistics; failures are counted by error label.
Percentiles use linear interpolation between closest ranks (numpy's default), so results match
`numpy.percentile` exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

from server.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty list, linear interpolation like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty list is undefined; check the list is non-empty first")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass
class Dist:
    """Mean and percentiles of one latency, in milliseconds; all None when there were no samples."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


def distribution(seconds: list[float]) -> Dist:
    """Summarise samples given in seconds as a `Dist` in milliseconds."""
    if not seconds:
        return Dist()
    ms = [s * 1000.0 for s in seconds]
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Dist(count=len(ms), mean=sum(ms) / len(ms), p50=p50, p90=p90, p99=p99)


@dataclass
class Slo:
    """Service-level objectives in milliseconds; None means "no objective" for that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    def is_empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.e2el is None

    def met_by(self, rec: RequestRecord) -> bool:
        """True iff `rec` succeeded and meets every objective that is set."""
        if not rec.ok:
            return False
        checks = (
            (self.ttft, rec.ttft),
            (self.tpot, rec.tpot()),
            (self.e2el, rec.latency),
        )
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def parse_slo(text: str) -> Slo:
    """Parse `ttft=500,tpot=50,e2el=2000` (ms; `:` also accepted as separator) into an `Slo`."""
    slo = Slo()
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.replace(":", "=").partition("=")
        if not sep or key.strip().lower() not in SLO_KEYS:
            raise ValueError(f"bad SLO item {part!r}: expected KEY=MS with KEY one of ttft, tpot, e2el")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO value in {part!r}: expected a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"SLO {part!r} must be a positive number of milliseconds")
        setattr(slo, SLO_KEYS[key.strip().lower()], ms)
    if slo.is_empty():
        raise ValueError(f"no SLO found in {text!r}; write e.g. --slo ttft=500,tpot=50")
    return slo


@dataclass
class Summary:
    """Aggregate results of one load level."""

    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    total_prompt_tokens: int | None
    concurrency_achieved: float
    goodput: float | None
    slo_met: int | None
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    fork: Dist
    cleanup_failures: int

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    """Compute a `Summary` from the records of one level and its wall time in seconds."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok]
    total_prompt = sum(prompt_counts) if ok and None not in prompt_counts else None
    met = sum(1 for r in ok if slo.met_by(r)) if slo and not slo.is_empty() else None
    tpots = [t for t in (r.tpot() for r in ok) if t is not None]
    return Summary(
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=_rate(len(ok), duration_s),
        output_throughput=_rate(out_tokens, duration_s),
        total_output_tokens=out_tokens,
        total_prompt_tokens=total_prompt,
        concurrency_achieved=_rate(sum(r.latency or 0.0 for r in ok), duration_s),
        goodput=None if met is None else _rate(met, duration_s),
        slo_met=met,
        ttft=distribution([r.ttft for r in ok if r.ttft is not None]),
        tpot=distribution(tpots),
        itl=distribution([gap for r in ok for gap in r.itl()]),
        e2el=distribution([r.latency for r in ok if r.latency is not None]),
        fork=distribution([r.fork_latency for r in records if r.fork_latency is not None]),
        cleanup_failures=sum(r.cleanup_failures for r in records),
    )
