"""Memory by owner over HTTP (`cellserve:memory_bytes{owner}` on /metrics, as the engine reports it) and the
idle trim (server/memory.py): once per idle period, never while a request runs."""

import time

from http_support import LiveServer, metric_value

from engine.loader.default import DEFAULT_MODEL_DIR
from server.memory import IdleTrim

OWNERS = ("weights", "cell_pool", "step_buffers", "grammar_cache", "prefix_index", "tokenizer", "allocator_free",
          "other")


def test_metrics_report_memory_by_owner():
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=4096, max_num_batched_tokens=256) as srv:
        report = srv.engine.memory()
        got = {owner: metric_value(srv, "cellserve:memory_bytes", owner=owner) for owner in OWNERS}
        assert got["weights"] == report.weights > 0
        assert got["cell_pool"] == srv.cache()["pool_bytes"] == 4096 * srv.cache()["cell_bytes"]
        assert got["step_buffers"] == report.step_buffers > 0
        assert got["tokenizer"] > 0 and got["other"] > 0
        rss = metric_value(srv, "process_resident_memory_bytes")
        assert got["weights"] + got["cell_pool"] < rss  # the owners are parts of the process, not estimates of it


def test_idle_trim_waits_for_idle_and_trims_once():
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=4096) as srv:
        trim = IdleTrim(srv.ctx.engine_stats, idle_s=0.3, poll_s=0.02).start()
        body = {"prompt": "ROMEO:", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with srv.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                assert trim.trims == 0  # never while a request runs
        srv.wait_idle()
        deadline = time.monotonic() + 10
        while trim.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trim.trims == 1 and trim.released_bytes >= 0
        time.sleep(1.0)
        assert trim.trims == 1  # once per idle period
