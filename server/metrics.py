"""Prometheus metrics: engine gauges/counters read at scrape time, latency histograms observed here.

Guarantees:
- Each app has its own `CollectorRegistry`, so several servers (or tests) in one process never clash.
- Engine state (running/waiting requests, cells used/free, preemptions, token counters) is read from
  `engine.stats()` when /metrics is scraped, so it is never stale and costs nothing per token.
- TTFT and end-to-end latency come from the engine's own `Timing` (queued -> first token ->
  finished); inter-token latency is the gap between consecutive token-bearing outputs of one engine
  request as the server receives them. Names follow vLLM's (`cellserve:` prefix instead of `vllm:`).
- The process itself: prometheus_client's standard `process_resident_memory_bytes`,
  `process_open_fds`, `process_cpu_seconds_total`, ... (read from /proc at scrape time), and its peak
  resident memory, `cellserve:process_peak_resident_memory_bytes` (VmHWM).
- Resident memory by owner (`cellserve:memory_bytes{owner=...}`: weights, cell_pool, step_buffers (the bound),
  grammar_cache, prefix_index, tokenizer, allocator_free, other; engine/api/memory.py says what each is), read
  from `engine.memory()` at scrape time, and the idle trims (server/memory.py) with the RSS they gave back.
"""

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api.memory import MemoryReport
from engine.api.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector(Collector):
    """Reads `EngineStats` at scrape time; yields nothing while the engine is not loaded."""

    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        gauges = {
            "num_requests_running": ("Requests generating (in the running batch).", s.running),
            "num_requests_waiting": ("Requests waiting to be admitted.", s.waiting),
            "num_idle_sequences": ("Persistent sequences with nothing running.", s.idle_sequences),
            "cells_total": ("KV cells in the pool.", s.n_cells),
            "cells_used": ("KV cells owned by at least one sequence (shared cells count once).", s.cells_used),
            "cells_free": ("KV cells owned by nobody.", s.cells_free),
            "kv_cache_usage_perc": ("Fraction of KV cells in use (0-1).", s.cells_used / max(1, s.n_cells)),
            "read_len": ("Length of the cell read window.", s.read_len),
        }
        counters = {
            "num_preemptions": ("Sequences preempted (cells freed, recomputed later).", s.preemptions),
            "prompt_tokens": ("Prompt tokens prefilled.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generated_tokens),
            "engine_steps": ("Engine forward steps (ticks).", s.steps),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens),
            "prefix_cache_hits": ("Prompt tokens whose cells came from the prefix cache.", s.prefix_hit_tokens),
            # vLLM's names for the same counts
            "spec_decode_num_draft_tokens": ("Tokens drafted by speculative decoding.", s.draft_tokens),
            "spec_decode_num_accepted_tokens": ("Drafted tokens kept.", s.accepted_draft_tokens),
        }
        for family, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, value) in table.items():
                yield family(f"cellserve:{name}", doc, value=value)


class PeakMemoryCollector(Collector):
    """The process's peak resident set (VmHWM, Linux /proc) at scrape time: what a deployment must size for
    (weights + cells + step buffers at their largest), which the current RSS hides once memory is returned."""

    def collect(self) -> Iterator[Metric]:
        try:
            with open("/proc/self/status") as f:
                line = next((x for x in f if x.startswith("VmHWM:")), None)
        except OSError:
            return
        if line is not None:
            yield GaugeMetricFamily("cellserve:process_peak_resident_memory_bytes",
                                    "Peak resident memory of this process (VmHWM).", value=int(line.split()[1]) * 1024)


class MemoryCollector(Collector):
    """`cellserve:memory_bytes{owner}` from the engine's `MemoryReport` at scrape time (nothing while loading),
    and the idle trims' counters once `trim` (a server.memory.IdleTrim) is attached."""

    def __init__(self, memory: Callable[[], MemoryReport | None]):
        self._memory = memory
        self.trim = None

    def collect(self) -> Iterator[Metric]:
        report = self._memory()
        if report is not None:
            family = GaugeMetricFamily("cellserve:memory_bytes", "Resident memory by owner (step_buffers: the "
                                       "bound one step may allocate; allocator_free: held by malloc, unused).",
                                       labels=["owner"])
            for owner, value in report.owners().items():
                family.add_metric([owner], value)
            yield family
        if self.trim is not None:
            yield CounterMetricFamily("cellserve:malloc_trims", "malloc_trim calls after the engine went idle.",
                                      value=self.trim.trims)
            yield CounterMetricFamily("cellserve:malloc_trim_released_bytes", "RSS the idle trims gave back.",
                                      value=self.trim.released_bytes)


class ServerMetrics:
    """The app's registry plus the latency histograms and request counters the routes feed."""

    def __init__(self, stats: Callable[[], EngineStats | None],
                 memory: Callable[[], MemoryReport | None] = lambda: None):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("cellserve:time_to_first_token_seconds", "Queued to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("cellserve:inter_token_latency_seconds",
                             "Gap between consecutive token-bearing outputs of one request.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("cellserve:e2e_request_latency_seconds", "Queued to finished.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.finished = Counter("cellserve:request_success", "Finished engine requests by finish reason.",
                                ["finished_reason"], registry=reg)
        self.errors = Counter("cellserve:request_errors",
                              "Requests answered with an error, by HTTP status (/health probes excluded).",
                              ["status"], registry=reg)
        self.edge_refusals = Counter("cellserve:http_edge_refusals",
                                     "Requests refused by the HTTP edge before the app saw them (head too large, "
                                     "malformed, unknown method), by HTTP status.", ["status"], registry=reg)
        reg.register(EngineCollector(stats))
        # process_resident_memory_bytes, open fds, CPU seconds, start time (Linux /proc; nothing elsewhere)
        ProcessCollector(registry=reg)
        reg.register(PeakMemoryCollector())
        self.memory = MemoryCollector(memory)
        reg.register(self.memory)

    def count_edge_refusal(self, status: int) -> None:
        self.edge_refusals.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestObserver:
    """Feeds one engine request's outputs into the histograms (one instance per engine request)."""

    def __init__(self, metrics: ServerMetrics | None):
        self._m = metrics
        self._last: float | None = None
        self._done: set[int] = set()

    def observe(self, out: RequestOutput) -> None:
        if self._m is None:
            return
        t = time.monotonic()
        if any(c.token_ids for c in out.outputs):
            if self._last is not None:
                self._m.itl.observe(t - self._last)
            self._last = t
        for c in out.outputs:
            if c.finish_reason and c.index not in self._done:
                self._done.add(c.index)
                self._m.finished.labels(finished_reason=c.finish_reason).inc()
        if out.finished:
            self._finish(out)

    def abandon(self, n: int) -> None:
        """The client left before the end: every choice not yet finished counts as cancelled."""
        if self._m is None:
            return
        for index in range(n):
            if index not in self._done:
                self._done.add(index)
                self._m.finished.labels(finished_reason="cancelled").inc()

    def _finish(self, out: RequestOutput) -> None:
        tm = out.timing
        if tm.first_token is not None and tm.queued:
            self._m.ttft.observe(max(0.0, tm.first_token - tm.queued))
        if tm.finished is not None and tm.queued:
            self._m.e2e.observe(max(0.0, tm.finished - tm.queued))
