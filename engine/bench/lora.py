"""LoRA adapters' cost in one flat step: 8 concurrent requests spread over 4 adapters against 8 on the base.

`python -m engine.bench.lora MODEL_FOLDER [--dtype bfloat16] [--rank 16] [--tokens 64]`: makes 4 random PEFT
folders (rank `--rank` on q,k,v,o,gate,up,down; written with safetensors, no PEFT needed), loads them, then runs
rounds of 8 greedy requests (same prompts, `--tokens` each, EOS ignored): on the base, then 2 per adapter
(one `lora_update` kernel call per linear; stacked oneDNN ops without it: `LoraRegistry.kernel`; one pass per
adapter: `LoraRegistry.stacking`), alternating (a drifting machine slows every kind alike). Prints each round's
decode tok/s and the ratio of the medians. Speculative decoding is off: every step has one row per sequence.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.api.args import EngineArgs
from engine.api.lora import LoraRef
from engine.api.sampling_params import SamplingParams
from engine.core.engine import Engine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> str:
    """A random PEFT LoRA folder for `config`'s shapes (every layer, every linear)."""
    cfg = config.get_text_config()
    h, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGETS), "bias": "none"}))
    return str(folder)


def one_round(engine: Engine, prompts: list[list[int]], names: list[str | None], tokens: int) -> float:
    """Decode tok/s of one round: every request's tokens after its first, over the time from the first token
    of the last request to start to the end."""
    for i, (ids, name) in enumerate(zip(prompts, names)):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                lora=LoraRef(name) if name else None)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
    while any(s.num_generated == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefills, and every request's first token
    start, generated = time.perf_counter(), engine.generated_tokens
    while engine.has_unfinished():
        engine.step()
    return (engine.generated_tokens - generated) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = Engine.from_args(EngineArgs(model=args.model, dtype=args.dtype, speculative="off", n_cells=4096,
                                         prefix_caching=False))
    tmp = Path(tempfile.mkdtemp())
    for k in range(4):
        engine.adapters.load(f"a{k}", write_adapter(tmp / f"a{k}", engine.runner.config, args.rank, k))
    vocab = engine.vocab_size
    prompts = [[(7919 * (j + 1) * (t + 3)) % (vocab - 10) + 5 for t in range(48)] for j in range(8)]
    spread = [f"a{j % 4}" for j in range(8)]
    kinds = {"base": ([None] * 8, True, True), "4 adapters": (spread, True, True),
             "no kernel": (spread, True, False), "per adapter": (spread, False, False)}
    loras = engine.runner.loras
    for names, loras.stacking, loras.kernel in kinds.values():  # warm-up
        one_round(engine, prompts, names, 8)
    results = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, (names, loras.stacking, loras.kernel) in kinds.items():
            results[kind].append(one_round(engine, prompts, names, args.tokens))
    for kind, values in results.items():
        print(f"{kind:>11}: decode tok/s {', '.join(f'{v:.1f}' for v in values)} (median {statistics.median(values):.1f})")
    base = statistics.median(results["base"])
    ratio = {k: statistics.median(v) / base for k, v in results.items()}
    adapter_bytes = sum(i.nbytes for i in engine.adapters.infos())
    print(f"ratio to base: 4 adapters {ratio['4 adapters']:.2f} (stacked oneDNN ops, no kernel: "
          f"{ratio['no kernel']:.2f}; one pass per adapter: {ratio['per adapter']:.2f}); 4 adapters hold "
          f"{adapter_bytes / 2**20:.1f} MiB (rank {args.rank}, all linears, {args.dtype})")


if __name__ == "__main__":
    main()
