"""Prompt logprobs (echo + logprobs, lm-evaluation-harness's loglikelihood): the engine keeps the logits of
every prompt row of a request that asks, across chunked prefill, and they equal the log_softmax of a
cacheless forward (the oracle); the first prompt token has none. Through HTTP: OpenAI's echo shape with
`max_tokens: 0` allowed, and what lm-eval's `local-completions` sends."""

import pytest
import torch
from engine_support import drain, make_engine, prompt
from http_support import LiveServer, sse_events
from tiny_models import full_logits

from engine.api.errors import InvalidRequest
from engine.api.sampling_params import SamplingParams

TOL = 1e-4


def oracle(model, ids: list[int], k: int = 0):
    """(logprob of token p given ids[:p] for p >= 1, top-k ids per position) from one cacheless forward."""
    lp = torch.log_softmax(full_logits(model, ids), dim=-1)
    chosen = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    top = lp[:-1].topk(k, dim=-1).indices.tolist() if k else None
    return chosen, top


def run(engine, reqs):
    """reqs: {request_id: (prompt ids, params)} -> {request_id: [RequestOutput, ...]}."""
    outs = {rid: [] for rid in reqs}
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params, outs[rid].append)
    drain(engine)
    return outs


def prompt_lps(outs):
    got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(got) == 1, "prompt logprobs come once, on the request's first output"
    return got[0]


def check(plp, ids, model, k):
    want, top = oracle(model, ids, k)
    assert plp.token_ids == ids and plp.logprobs[0] is None and plp.top[0] is None
    assert len(plp.logprobs) == len(ids)
    assert torch.allclose(torch.tensor(plp.logprobs[1:]), torch.tensor(want), atol=TOL)
    if k:
        assert [[t for t, _ in row] for row in plp.top[1:]] == top


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_over_several_chunks_equal_the_oracle(max_tokens):
    engine = make_engine(n_cells=512, max_num_batched_tokens=16)  # a 50-token prompt takes 4 chunks
    ids = prompt(50, seed=1)
    busy = prompt(9, seed=2)
    outs = run(engine, {
        "busy": (busy, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),  # shares the steps
        "lp": (ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=2)),
    })
    check(prompt_lps(outs["lp"]), ids, engine.runner.model, 2)
    generated = [t for o in outs["lp"] for c in o.outputs for t in c.token_ids]
    assert len(generated) == max_tokens
    assert all(o.prompt_logprobs is None for o in outs["busy"])
    assert engine.cache.free_cells() + engine.scheduler.cached_prefix_cells() == engine.cache.n_cells


def test_a_cached_prefix_is_not_shared_when_every_prompt_row_is_needed():
    engine = make_engine(n_cells=512, max_num_batched_tokens=32)
    ids = prompt(40, seed=3)
    run(engine, {"warm": (ids, SamplingParams(max_tokens=1, temperature=0))})  # leaves a cached prefix
    outs = run(engine, {"lp": (ids + [5, 6], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))})
    check(prompt_lps(outs["lp"]), ids + [5, 6], engine.runner.model, 0)


def test_n_choices_and_single_token_prompt():
    engine = make_engine(n_cells=512)
    ids = prompt(12, seed=4)
    outs = run(engine, {"n": (ids, SamplingParams(max_tokens=2, temperature=1.0, seed=0, n=3, prompt_logprobs=1)),
                        "one": ([7], SamplingParams(max_tokens=0, prompt_logprobs=0))})
    check(prompt_lps(outs["n"]), ids, engine.runner.model, 1)
    assert prompt_lps(outs["one"]).logprobs == [None]


def test_prompt_logprobs_are_refused_on_a_sequence_continuation():
    engine = make_engine(n_cells=256)
    seq, _ = engine.create_sequence(prompt(5, seed=5))
    drain(engine)
    with pytest.raises(InvalidRequest, match="prompt logprobs"):
        engine.add_request("x", [3, 4], SamplingParams(max_tokens=1, prompt_logprobs=0), seq_id=seq.seq_id)


# ----- HTTP: echo + logprobs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, max_num_batched_tokens=16) as server:
        yield server


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()


def test_echo_with_logprobs_and_max_tokens_zero(srv, hf_model):
    ids = prompt(40, seed=6)
    want, _ = oracle(hf_model, ids)
    with srv.client() as c:
        for max_tokens in (0, 1):
            body = c.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "echo": True,
                                                   "logprobs": 1, "temperature": 0}).json()
            choice = body["choices"][0]
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), torch.tensor(want), atol=TOL)
            assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
            assert body["usage"]["completion_tokens"] == max_tokens
            if max_tokens == 0:
                assert choice["finish_reason"] == "length" and choice["text"]


def test_lm_eval_loglikelihood_request_shape(srv, hf_model):
    """What lm-eval's local-completions sends for loglikelihood: token-id prompts (context + continuation),
    echo, logprobs 1, max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1] and top_logprobs."""
    ctx, conts = prompt(20, seed=7), [prompt(3, seed=8), prompt(5, seed=9)]
    prompts = [ctx + cont for cont in conts]
    with srv.client() as c:
        body = c.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                               "temperature": 0, "seed": 1234}).json()
    for choice, ids in zip(body["choices"], prompts):
        want, _ = oracle(hf_model, ids)
        got = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        assert torch.allclose(torch.tensor(got), torch.tensor(want[len(ctx) - 1:]), atol=TOL)
        for tok_lp, top in zip(got, choice["logprobs"]["top_logprobs"][len(ctx):-1]):
            assert max(top.values()) >= tok_lp - TOL


def test_streamed_echo_carries_the_prompt_logprobs_first(srv):
    ids = prompt(10, seed=10)
    with srv.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    lps = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"]]
    tokens = [t for lp in lps for t in lp["token_logprobs"]]
    assert tokens[0] is None and len(tokens) == len(ids) + 3 and None not in tokens[1:]


def test_vllm_prompt_logprobs_field(srv, hf_model):
    ids = prompt(12, seed=11)
    want, top = oracle(hf_model, ids, 2)
    lp = torch.log_softmax(full_logits(hf_model, ids), dim=-1)
    with srv.client() as c:
        body = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
                                               "temperature": 0}).json()
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "prompt_logprobs": 1, "max_tokens": 1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["text"] is not None
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p, entry in enumerate(plp[1:], start=1):
        actual = entry[str(ids[p])]
        assert abs(actual["logprob"] - want[p - 1]) < TOL
        assert actual["rank"] == int((lp[p - 1] > lp[p - 1, ids[p]]).sum()) + 1
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= 2)
        assert [t for _, t in ranked][:2] == top[p - 1]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_max_tokens_zero_needs_echo(srv, body, param):
    with srv.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
