"""LoRA adapters over HTTP (server/adapters/): a request naming an adapter as its `model` (vLLM) or by
llama.cpp's `lora: [{id, scale}]` gets the PEFT model's greedy text; /v1/models lists the adapters with their
parent and bytes; the load/unload routes (behind --api-key), their refusals; the prefix cache never serves one
adapter's cells to another (usage.prompt_tokens_details.cached_tokens). Real uvicorn, real engine; the oracle
is PEFT's merged model run by `generate` (engine_support.generate_oracle)."""

import json

import httpx
import pytest
import torch
from engine_support import generate_oracle
from http_support import API_KEY, MODEL_NAME, LiveServer, metric_value
from lora_support import ATTN, peft_adapter
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

PROMPT = "ROMEO: But soft, what light through yonder window breaks? JULIET: O Romeo, Romeo"


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two adapters of the served tiny model: their folders and oracles ({None: the base})."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("http-adapters")
    pa, ma = peft_adapter(base, folder / "a", r=8, seed=3, magnitude=1.0)
    pb, mb = peft_adapter(base, folder / "b", r=16, targets=ATTN, seed=4, magnitude=1.0)
    return {"a": pa, "b": pb}, {None: base, "a": ma, "b": mb}


def _text(model, tok, ids, k=12) -> str:
    return tok.decode(generate_oracle(model, ids, k), skip_special_tokens=True)


def _complete(c, model, **extra) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    return c.post("/v1/completions", json=body).raise_for_status().json()


def test_requests_naming_an_adapter_get_the_peft_models_greedy_text(model_dir, adapters):
    paths, oracles = adapters
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT).input_ids
    want = {name: _text(m, tok, ids) for name, m in oracles.items()}
    assert len(set(want.values())) == 3  # the adapters change the text
    with LiveServer(model_dir, lora_modules={"a": paths["a"]}, api_key=API_KEY) as srv, srv.client() as c:
        cards = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in cards] == [MODEL_NAME, "a"]
        assert cards[1]["parent"] == MODEL_NAME and cards[1]["lora"]["bytes"] > 0 and cards[1]["lora"]["rank"] == 8
        assert _complete(c, "a")["choices"][0]["text"] == want["a"]
        assert _complete(c, MODEL_NAME)["choices"][0]["text"] == want[None]
        # llama.cpp's per-request list: id 0 is the first --lora
        assert _complete(c, MODEL_NAME, lora=[{"id": 0, "scale": 1.0}])["choices"][0]["text"] == want["a"]
        chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
        got = c.post("/v1/chat/completions", json=chat).raise_for_status().json()
        assert got["choices"][0]["message"]["content"] == _text(oracles["a"], tok, list(chat_ids), 8)
        # the load route, then a request under the new adapter, then unloading it
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == 1
        assert _complete(c, "b")["choices"][0]["text"] == want["b"]
        assert metric_value(srv, "cellserve:lora_adapter_bytes", adapter="b") == r.json()["bytes"]
        assert metric_value(srv, "cellserve:memory_bytes", owner="lora_adapters") >= r.json()["bytes"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL_NAME, "a"]
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "lora": [{"id": 1}]})
        assert r.status_code == 404 and "loaded: a" in r.json()["error"]["message"]


def test_load_unload_refusals_are_clear_and_change_nothing(model_dir, adapters, tmp_path):
    """--max-lora-memory 50 kB holds "a" (48 kB) or "b" (44 kB), not both: loading "b" unloads "a" (least recently
    used, not in use); an r 32 adapter (192 kB) can never fit: 507."""
    paths, oracles = adapters
    big, _ = peft_adapter(oracles[None], tmp_path / "big", r=32)
    moe = tmp_path / "moe"  # an adapter of a mixture-of-experts model's experts
    moe.mkdir()
    key = "base_model.model.model.layers.0.mlp.experts.2.up_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 8), f"{key}.lora_B.weight": torch.zeros(8, 4)},
              str(moe / "adapter_model.safetensors"))
    (moe / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with LiveServer(model_dir, lora_modules={"a": paths["a"]}, api_key=API_KEY, max_lora_memory=50_000) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as anon:
            assert anon.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}).status_code == 401
        with srv.client() as c:
            cases = [
                ({"lora_name": "x", "lora_path": str(tmp_path / "nothing")}, 400, "not a PEFT LoRA folder"),
                ({"lora_name": "a", "lora_path": paths["b"]}, 400, "already loaded"),
                ({"lora_name": MODEL_NAME, "lora_path": paths["b"]}, 400, "base model's name"),
                ({"lora_name": "big", "lora_path": big}, 507, "more than max_lora_memory"),
                ({"lora_name": "moe", "lora_path": str(moe)}, 400, "targets layers.0.mlp.experts.2.up_proj"),
            ]
            for body, status, words in cases:
                r = c.post("/v1/load_lora_adapter", json=body)
                assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "zzz"})
            assert r.status_code == 404 and "loaded: a" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "lora": [{"id": 0}, {"id": 0}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL_NAME, "a"]  # nothing changed
            assert c.get("/lora-adapters").json()[0]["path"] == paths["a"]
            assert c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}).status_code == 200
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL_NAME, "b"]  # "a" made room


def test_an_adapter_request_never_reuses_the_bases_cached_prefix(model_dir, adapters):
    paths, _ = adapters
    long_prompt = PROMPT * 3  # several 16-token blocks
    with LiveServer(model_dir, lora_modules=paths) as srv, srv.client() as c:
        def cached(model):
            body = _complete(c, model, prompt=long_prompt, max_tokens=2)
            return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

        assert cached(MODEL_NAME) == 0
        assert cached(MODEL_NAME) >= 32  # the base's own prefix is found
        assert cached("a") == 0  # not the base's cells
        assert cached("b") == 0  # nor "a"'s
        assert cached("a") >= 32 and cached("b") >= 32  # each its own


def test_responses_and_messages_take_the_adapter_as_model(model_dir, adapters):
    """/v1/responses and /v1/messages (no ignore_eos there): the adapter named as `model` gives its PEFT model's
    greedy reply to the chat-templated prompt, up to its first end-of-sequence token; the base's name the base's."""
    paths, oracles = adapters
    tok = AutoTokenizer.from_pretrained(model_dir)
    turn = [{"role": "user", "content": "hi"}]
    ids = list(tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}

    def reply(name):
        out = generate_oracle(oracles[name], ids, 8)
        cut = next((i for i, t in enumerate(out) if t in stops), len(out))
        return tok.decode(out[:cut], skip_special_tokens=True)

    want = {"a": reply("a"), MODEL_NAME: reply(None)}
    assert want["a"] and want["a"] != want[MODEL_NAME]
    with LiveServer(model_dir, lora_modules={"a": paths["a"]}) as srv, srv.client() as c:
        for model, text in want.items():
            r = c.post("/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["output"][-1]["content"][0]["text"] == text, model
            r = c.post("/v1/messages", json={"model": model, "messages": turn, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["content"][0]["text"] == text, model
