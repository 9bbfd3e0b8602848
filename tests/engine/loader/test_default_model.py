"""The bundled default model: complete and small, loads offline, has learned something (held-out
perplexity far below the best unigram model of the same text), generates deterministically and as valid
UTF-8, and its byte-level tokenizer is lossless on any Unicode text."""

import math
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.loader.default import DEFAULT_MODEL_DIR, HELDOUT_TEXT_PATH
from engine.model.runner import ModelRunner

REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")
MAX_FOLDER_BYTES = 25 * 1024 * 1024
PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True,
                                                dtype=torch.float32).eval()


def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table, the alphabet of byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def test_folder_is_complete_and_small():
    sizes = {name: (DEFAULT_MODEL_DIR / name).stat().st_size for name in REQUIRED_FILES}
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    print(f"default model folder: {total / 1e6:.1f} MB")
    assert all(size > 0 for size in sizes.values())
    assert total <= MAX_FOLDER_BYTES
    assert 1_000 <= len(HELDOUT_TEXT_PATH.read_text(encoding="utf-8")) <= 50_000


def test_loads_offline_on_a_fresh_machine(tmp_path):
    """A fresh interpreter with an empty HF cache, HF_HUB_OFFLINE=1 and sockets that refuse to connect."""
    script = textwrap.dedent(f"""
        import socket
        def refuse(*args, **kwargs):
            raise OSError("network access attempted while loading the bundled model")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = {str(DEFAULT_MODEL_DIR)!r}
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        ids = tok("ROMEO:", return_tensors="pt").input_ids
        print(type(model).__name__, model(input_ids=ids).logits.shape[-1], len(tok))
    """)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    name, logits_width, vocab = out.stdout.split()[-3:]
    assert name == "LlamaForCausalLM"
    assert int(logits_width) == int(vocab)


def test_config_is_a_small_gqa_llama(model, tokenizer):
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"default model: {n_params / 1e6:.2f}M parameters")
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert 1_000_000 <= n_params <= 10_000_000
    assert cfg.vocab_size == len(tokenizer)
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3


def heldout_nll(model, ids: list[int], bos_id: int, window: int) -> float:
    """Mean next-token NLL over `ids` in consecutive BOS-prefixed windows, via transformers' own loss."""
    total, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        inputs = torch.tensor([[bos_id, *chunk]])
        labels = inputs.clone()
        labels[0, 0] = -100
        with torch.inference_mode():
            loss = model(input_ids=inputs, labels=labels).loss.item()
        total += loss * len(chunk)
        count += len(chunk)
    return total / count


def test_heldout_perplexity_far_below_unigram_baseline(model, tokenizer):
    ids = tokenizer(HELDOUT_TEXT_PATH.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False).input_ids
    counts = Counter(ids)
    # Maximum-likelihood unigram fitted on the held-out text itself: the best any unigram model can do.
    unigram_nll = -sum(c * math.log(c / len(ids)) for c in counts.values()) / len(ids)
    model_nll = heldout_nll(model, ids, tokenizer.bos_token_id, window=model.config.max_position_embeddings - 1)
    model_ppl, unigram_ppl = math.exp(model_nll), math.exp(unigram_nll)
    threshold = 0.35 * unigram_ppl
    print(f"held-out: {len(ids)} tokens, model ppl {model_ppl:.2f}, unigram ppl {unigram_ppl:.2f}, "
          f"threshold {threshold:.2f}")
    assert model_ppl < threshold


def test_greedy_generation_is_deterministic_and_valid_utf8(model, tokenizer):
    inputs = tokenizer(PROMPT, return_tensors="pt")
    first = model.generate(**inputs, do_sample=False, max_new_tokens=40)
    second = model.generate(**inputs, do_sample=False, max_new_tokens=40)
    assert torch.equal(first, second)
    new_ids = first[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new_ids) == 40 or new_ids[-1] == tokenizer.eos_token_id
    text_ids = [i for i in new_ids if i not in tokenizer.all_special_ids]
    table = byte_decoder()
    raw = bytes(table[ch] for tok in tokenizer.convert_ids_to_tokens(text_ids) for ch in tok)
    text = raw.decode("utf-8")  # strict: raises on any invalid or truncated sequence
    print(f"greedy continuation of {PROMPT!r}: {text!r}")
    assert text == tokenizer.decode(text_ids)
    assert sum(ch.isalpha() for ch in text) >= 10


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_unicode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_encoding_prepends_bos(tokenizer):
    ids = tokenizer(PROMPT).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == tokenizer(PROMPT, add_special_tokens=False).input_ids


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Speak briefly."}, {"role": "user", "content": "Who art thou?"},
                {"role": "assistant", "content": "A friend."}, {"role": "user", "content": "Whence?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|bos|>SYSTEM.\nSpeak briefly.\n\nUSER.\nWho art thou?\n\nASSISTANT.\nA friend.\n\n"
                        "USER.\nWhence?\n\nASSISTANT.\n")
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Who art thou?\n\n")
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_model_runner_serves_default_model_like_transformers(model, tokenizer):
    """Greedy decoding over the cell pool reproduces transformers' own greedy generate, token for token."""
    runner = ModelRunner.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32, n_cells=256, threads=1)
    assert runner.tokenizer.get_vocab() == tokenizer.get_vocab()
    prompt = runner.tokenizer(PROMPT).input_ids
    expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)[0, len(prompt):]
    generated, chunk, pos = [], prompt, 0
    for _ in range(16):
        logits = runner.run({0: (chunk, pos)})[0]
        pos += len(chunk)
        chunk = [int(logits.argmax())]
        generated += chunk
    assert generated == expected.tolist()
