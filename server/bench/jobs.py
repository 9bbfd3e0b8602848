"""Turns a workload into a runner `Job`: what one unit of load does against the server."""

from __future__ import annotations

import time

import httpx

from server.bench.client import RequestOptions, build_request, stream_request
from server.bench.copying import CopyWorkload
from server.bench.forktree import run_tree
from server.bench.multiturn import MultiTurnWorkload, run_conversation
from server.bench.records import RequestRecord
from server.bench.regen import RegenWorkload, run_regen
from server.bench.runner import Job
from server.bench.workloads import ForkTreeWorkload, RandomWorkload, SharedPrefixWorkload

Workload = RandomWorkload | SharedPrefixWorkload | ForkTreeWorkload | MultiTurnWorkload | CopyWorkload | RegenWorkload


def make_job(workload: Workload, opts: RequestOptions, base_url: str) -> tuple[Job, int]:
    """The job for `workload` and how many requests one job may have in flight at once."""
    if isinstance(workload, ForkTreeWorkload):
        async def tree_job(client: httpx.AsyncClient, i: int, t0: float) -> list[RequestRecord]:
            return await run_tree(client, base_url, workload.tree(i), i, t0, opts)

        return tree_job, workload.branches
    if isinstance(workload, MultiTurnWorkload):
        async def conversation_job(client: httpx.AsyncClient, i: int, t0: float) -> list[RequestRecord]:
            return await run_conversation(client, base_url, workload.conversation(i), i, t0, opts)

        return conversation_job, 1
    if isinstance(workload, RegenWorkload):
        async def regen_job(client: httpx.AsyncClient, i: int, t0: float) -> list[RequestRecord]:
            return await run_regen(client, base_url, workload.question(i), workload.output_len, i, t0, opts)

        return regen_job, 1

    async def request_job(client: httpx.AsyncClient, i: int, t0: float) -> list[RequestRecord]:
        prompt = workload.prompt(i)
        path, body = build_request(opts, prompt, i)
        rec = RequestRecord(index=i, kind=opts.endpoint, group=prompt.group, max_tokens=prompt.max_tokens,
                            prompt_words=prompt.words, sent_at=time.perf_counter() - t0)
        return [await stream_request(client, base_url + path, body, rec, opts.headers())]

    return request_job, 1
