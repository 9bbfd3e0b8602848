"""llama.cpp's native API over a real server: `/completion` (text, token-id and mixed prompts, `n_predict`,
`n_probs`, `timings`, the native stream without `[DONE]`) equals the offline engine's greedy output;
`/tokenize` `/detokenize` `/apply-template` `/props` in llama.cpp's fields; `/infill` builds the
prefix-suffix-middle prompt from a tokenizer's FIM tokens (a tiny model that has them) and is a clear 400
for a model without; slots keep their prompt's cells between requests and save/restore/erase through
`--state-dir`."""

import json
from pathlib import Path

import pytest
import torch
from http_support import Greedy, LiveServer, sse_events
from tiny_models import tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>")


@pytest.fixture(scope="module")
def greedy(model_dir):
    return Greedy(model_dir)


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    with LiveServer(model_dir, state_dir=str(tmp_path_factory.mktemp("state"))) as server:
        yield server


def test_completion_matches_the_engine_with_llamacpp_fields(srv, greedy):
    ids = greedy.tokenizer.encode("hello world")
    want = greedy(ids, 6, logprobs=2)
    with srv.client() as c:
        for prompt in ("hello world", ids, [ids[0], "ello world"]):
            got = c.post("/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0, "n_probs": 2,
                                              "return_tokens": True}).json()
            assert got["content"] == want.text and got["tokens"] == want.token_ids, prompt
            assert got["stop"] is True and got["stop_type"] == "limit" and got["tokens_predicted"] == 6
            assert got["tokens_evaluated"] == len(ids)
            t = got["timings"]
            assert t["predicted_n"] == 6 and t["prompt_n"] + t["cache_n"] == len(ids) and t["predicted_ms"] > 0
            probs = got["completion_probabilities"]
            assert [p["id"] for p in probs] == want.token_ids
            for p, lp in zip(probs, want.logprobs):
                assert p["logprob"] == pytest.approx(lp.logprob, abs=1e-4) and len(p["top_logprobs"]) == 2
                assert p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][1]["logprob"]
        stopped = c.post("/completion", json={"prompt": "hello world", "n_predict": 6, "temperature": 0,
                                              "stop": [want.text[2:4]]}).json()
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == want.text[2:4]
        assert stopped["content"] == want.text[:2]


def test_native_stream_ends_with_the_final_object_and_no_done(srv, greedy):
    want = greedy(greedy.tokenizer.encode("to be or"), 8)
    with srv.client() as c, c.stream("POST", "/completion", json={"prompt": "to be or", "n_predict": 8,
                                                                   "temperature": 0, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "[DONE]" not in events and all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events[:-1]) == want.text
    assert events[-1]["stop"] is True and events[-1]["content"] == "" and events[-1]["tokens_predicted"] == 8
    assert events[-1]["timings"]["predicted_n"] == 8


def test_bad_native_requests_are_400_naming_the_field(srv):
    with srv.client() as c:
        for body, param in (({"prompt": "x", "mirostat": 2}, "mirostat"), ({"prompt": [10**6]}, "prompt"),
                            ({"prompt": "x", "n_predict": -2}, "n_predict"), ({"prompt": "x", "id_slot": 99}, "id_slot"),
                            ({"prompt": "x", "logit_bias": [["word", 1]]}, "logit_bias")):
            r = c.post("/completion", json=body)
            assert r.status_code == 400 and param in r.json()["error"]["param"], (body, r.text)



def test_ignore_eos_bans_the_end_tokens_as_llamacpp_does(srv, greedy):
    """llama.cpp's `ignore_eos` is a -inf bias on the end-of-generation tokens, listed in the answer's
    `generation_settings.logit_bias` (null bias); a pushed-up EOS then still never comes out."""
    eos = greedy.tokenizer.eos_token_id
    body = {"prompt": "hello world", "n_predict": 5, "temperature": 0, "logit_bias": [[eos, 100], [7, False]]}
    with srv.client() as c:
        ends = c.post("/completion", json=body).json()
        runs = c.post("/completion", json={**body, "ignore_eos": True, "return_tokens": True}).json()
    assert ends["stop_type"] == "eos" and ends["tokens_predicted"] == 1
    assert ends["generation_settings"]["logit_bias"] == [{"bias": 100.0, "token": eos}, {"bias": None, "token": 7}]
    assert runs["stop_type"] == "limit" and len(runs["tokens"]) == 5 and not {eos, 7} & set(runs["tokens"])
    assert runs["generation_settings"]["logit_bias"] == [{"bias": None, "token": eos}, {"bias": None, "token": 7}]
    assert runs["generation_settings"]["ignore_eos"] is True

def test_tokenize_detokenize_template_and_props(srv, greedy):
    tok = greedy.tokenizer
    with srv.client() as c:
        plain = c.post("/tokenize", json={"content": "hello world"}).json()
        assert plain == {"tokens": tok.encode("hello world", add_special_tokens=False)}
        special = c.post("/tokenize", json={"content": "hello", "add_special": True}).json()["tokens"]
        assert special == tok.encode("hello")
        pieces = c.post("/tokenize", json={"content": "hello world", "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == plain["tokens"] and "".join(p["piece"] for p in pieces) == "hello world"
        assert c.post("/detokenize", json={"tokens": plain["tokens"]}).json()["content"] == "hello world"
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["count"] == len(tok.encode("hi"))  # vLLM's, unchanged
        msgs = [{"role": "user", "content": "hi"}]
        rendered = c.post("/apply-template", json={"messages": msgs}).json()["prompt"]
        assert rendered == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] >= 1
        assert props["chat_template"] == tok.chat_template and props["infill"] is False
        assert props["build_info"].startswith("b") and props["build_info"].endswith("-cellserve")  # llama.cpp's form
        r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_slots_reuse_cells_and_save_restore_erase(srv, greedy):
    prompt = "the slot keeps this prompt"
    want = greedy(greedy.tokenizer.encode(prompt), 5).text
    body = {"prompt": prompt, "n_predict": 5, "temperature": 0}
    with srv.client() as c:
        first = c.post("/completion", json={**body, "id_slot": 3}).json()
        again = c.post("/completion", json={**body, "id_slot": 3}).json()
        assert first["content"] == again["content"] == want and again["id_slot"] == 3
        assert again["tokens_cached"] == again["tokens_evaluated"] - 1 > first["tokens_cached"]  # llama-server's too
        assert again["timings"]["prompt_n"] == 1
        fresh = c.post("/completion", json={**body, "id_slot": 3, "cache_prompt": False}).json()
        assert fresh["content"] == want and fresh["tokens_cached"] == 0
        saved = c.post("/slots/3?action=save", json={"filename": "three.bin"}).json()
        assert saved["n_saved"] == fresh["tokens_evaluated"] + 5 and saved["n_written"] > 0
        assert (Path(srv.ctx.state_dir) / "slots" / "three.bin").stat().st_size == saved["n_written"]
        assert c.post("/slots/3?action=erase").json()["n_erased"] == saved["n_saved"]
        slots = {s["id"]: s for s in c.get("/slots").json()}
        assert slots[3]["n_past"] == 0
        restored = c.post("/slots/0?action=restore", json={"filename": "three.bin"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        assert c.get("/slots").json()[0]["n_past"] == saved["n_saved"]
        back = c.post("/completion", json={**body, "id_slot": 0}).json()
        assert back["content"] == want and back["tokens_cached"] == back["tokens_evaluated"] - 1
        for path, payload, status in (("/slots/0?action=restore", {"filename": "missing.bin"}, 404),
                                      ("/slots/0?action=save", {"filename": "../x"}, 400),
                                      ("/slots/0?action=fly", {"filename": "a"}, 400),
                                      ("/slots/99?action=erase", None, 400)):
            assert c.post(path, json=payload).status_code == status, path
        c.post("/slots/0?action=erase")


def _fim_model_dir(path: Path) -> str:
    """The tiny test model with StarCoder's FIM tokens in its tokenizer."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(FIM)})
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_infill_builds_the_fim_prompt_from_the_tokenizer(tmp_path):
    folder = _fim_model_dir(tmp_path / "fim")
    greedy = Greedy(folder)
    tok = greedy.tokenizer
    pre, suf, mid, sep = (tok.convert_tokens_to_ids(t) for t in FIM)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    ids = [sep, *enc("util.py\n"), *enc("x = 1"), pre, *enc("def f("), suf, *enc(")\n"), mid, *enc("a")]
    want = greedy(ids, 6)
    with LiveServer(folder) as srv, srv.client() as c:
        assert c.get("/props").json()["infill"] is True
        got = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "a",
                                      "input_extra": [{"filename": "util.py", "text": "x = 1"}],
                                      "n_predict": 6, "temperature": 0, "return_tokens": True}).json()
    assert got["tokens"] == want.token_ids and got["content"] == want.text
    assert got["tokens_evaluated"] == len(ids) and got["prompt"] == tok.decode(ids)
    assert json.dumps(got["prompt"]).count("<fim_") == 3


def test_curl_d_without_a_content_type_is_read_as_json(srv):
    """`curl -d '{...}'` sends `application/x-www-form-urlencoded`: read as JSON, as llama-server does."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with srv.client() as c:
        got = c.post("/completion", content=json.dumps({"prompt": "hello", "n_predict": 2}), headers=form)
        assert got.status_code == 200 and got.json()["tokens_predicted"] == 2
        bad = c.post("/completion", content="prompt=hello", headers=form)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]


def test_a_json_prompt_is_its_text_and_media_are_refused(srv):
    with srv.client() as c:
        want = c.post("/completion", json={"prompt": "hello", "n_predict": 3, "temperature": 0}).json()["content"]
        got = c.post("/completion", json={"prompt": {"prompt_string": "hello"}, "n_predict": 3, "temperature": 0})
        assert got.status_code == 200 and got.json()["content"] == want
        media = c.post("/completion", json={"prompt": {"prompt_string": "x <__media__>", "multimodal_data": ["AAAA"]}})
        assert media.status_code == 400 and "multimodal_data" in media.json()["error"]["message"]
