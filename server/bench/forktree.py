"""The fork-tree workload over cellserve's stateful sequences API.

One tree: POST /v1/sequences {prompt} -> trunk id; the trunk generates (a "trunk" record); then
`branches` times POST /v1/sequences/{trunk}/fork {} -> child id, and all children continue at once
with their own short prompt (one "branch" record each, with the fork call's latency); finally every
sequence is DELETEd (children first). A tree never raises: failures become error records, and
failed DELETEs are counted in the trunk record's `cleanup_failures` (a leak on the server side).

Servers without the API answer 404 (or 405) on POST /v1/sequences; `probe_sequences` detects that
once before the level so the workload is reported as skipped instead of as N failures.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from server.bench.client import RequestOptions, error_message, stream_request
from server.bench.records import RequestRecord
from server.bench.workloads import TreePlan

UNSUPPORTED = (404, 405)


async def probe_sequences(client: httpx.AsyncClient, base_url: str, opts: RequestOptions) -> str | None:
    """None when the server supports /v1/sequences, else a one-line reason to report it skipped."""
    try:
        resp = await client.post(f"{base_url}/v1/sequences", json={"prompt": "probe"}, headers=opts.headers())
    except httpx.HTTPError as exc:
        return f"cannot reach {base_url}/v1/sequences: {exc}"
    if resp.status_code in UNSUPPORTED:
        return f"server answered {resp.status_code} for POST /v1/sequences (no stateful sequences API)"
    if resp.status_code != 200:
        return f"POST /v1/sequences answered {resp.status_code}: {error_message(resp.content)}"
    seq_id = resp.json().get("id")
    if seq_id is not None:
        await client.delete(f"{base_url}/v1/sequences/{seq_id}", headers=opts.headers())
    return None


async def _post_for_id(client: httpx.AsyncClient, url: str, body: dict, opts: RequestOptions):
    """POST and return (id or None, status, error message, seconds taken)."""
    t0 = time.perf_counter()
    try:
        resp = await client.post(url, json=body, headers=opts.headers())
    except httpx.HTTPError as exc:
        return None, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
    took = time.perf_counter() - t0
    if resp.status_code != 200:
        return None, resp.status_code, error_message(resp.content), took
    seq_id = resp.json().get("id")
    if seq_id is None:
        return None, resp.status_code, "answer has no 'id'", took
    return str(seq_id), resp.status_code, "", took


def _completion_body(opts: RequestOptions, prompt: str | None, max_tokens: int) -> dict:
    body = {"prompt": prompt} if prompt else {}
    body.update(opts.sampling(max_tokens))
    return body


async def _branch(
    client: httpx.AsyncClient, base: str, trunk_id: str, text: str, rec: RequestRecord, opts: RequestOptions
) -> tuple[RequestRecord, str | None]:
    child, status, msg, took = await _post_for_id(client, f"{base}/v1/sequences/{trunk_id}/fork", {}, opts)
    rec.fork_latency = took if child else None
    if child is None:
        return rec.fail(str(status) if status else "transport", f"fork failed: {msg}", status), None
    url = f"{base}/v1/sequences/{child}/completions"
    body = _completion_body(opts, text, rec.max_tokens)
    return await stream_request(client, url, body, rec, opts.headers()), child


async def _delete(client: httpx.AsyncClient, base: str, seq_id: str, opts: RequestOptions) -> bool:
    try:
        resp = await client.delete(f"{base}/v1/sequences/{seq_id}", headers=opts.headers())
    except httpx.HTTPError:
        return False
    return resp.status_code in (200, 204)


async def run_tree(
    client: httpx.AsyncClient, base: str, plan: TreePlan, index: int, t_level: float, opts: RequestOptions
) -> list[RequestRecord]:
    """Run one fork tree; returns the trunk record followed by one record per branch."""
    trunk = RequestRecord(
        index=index, kind="trunk", group=index, max_tokens=plan.max_tokens,
        prompt_words=plan.trunk_words, sent_at=time.perf_counter() - t_level,
    )
    trunk_id, status, msg, _ = await _post_for_id(client, f"{base}/v1/sequences", {"prompt": plan.trunk}, opts)
    if trunk_id is None:
        return [trunk.fail(str(status) if status else "transport", f"create failed: {msg}", status)]
    body = _completion_body(opts, None, plan.max_tokens)
    await stream_request(client, f"{base}/v1/sequences/{trunk_id}/completions", body, trunk, opts.headers())
    branches: list[RequestRecord] = []
    children: list[str] = []
    if trunk.ok:
        now = time.perf_counter() - t_level
        recs = [
            RequestRecord(index=index, kind="branch", group=index, max_tokens=plan.max_tokens,
                          prompt_words=len(text.split()), sent_at=now)
            for text in plan.branches
        ]
        done = await asyncio.gather(*(_branch(client, base, trunk_id, t, r, opts)
                                      for t, r in zip(plan.branches, recs)))
        branches = [rec for rec, _ in done]
        children = [child for _, child in done if child is not None]
    deleted = await asyncio.gather(*(_delete(client, base, c, opts) for c in children))
    trunk.cleanup_failures = deleted.count(False) + (0 if await _delete(client, base, trunk_id, opts) else 1)
    return [trunk] + branches
