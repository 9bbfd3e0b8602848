"""What the engine-side benchmarks share: the 56M Llama they run, its prompts, `Row` (one measured
run), `Clock`, and transformers' sequential `generate` baseline."""

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class Row:
    system: str
    concurrency: int
    generated_tokens: int
    wall_s: float
    cpu_s: float
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    outside_forward: float | None = None
    gap_p50_ms: float | None = None  # wall time of the steps during which some sequence was decoding:
    gap_p99_ms: float | None = None  # each is a gap between two tokens of that sequence's stream
    gap_cpu_p99_ms: float | None = None  # the same in process CPU time (steadier on a shared machine)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s


class Clock:
    """Wall and process-CPU time together (CPU time counts every torch thread; steadier on a shared box)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """(wall s, cpu s) since the last lap, or since the clock was made."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def bench_llama_56m(seed: int = 0):
    """The benchmarks' model: Llama, hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 32000, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def save_bench_model(path, dtype: str = "float32", words: Iterable[str] = ()) -> str:
    """The 56M model as a servable folder, with a 32000-word WordLevel tokenizer (`words` first: the
    load generator's common English words, then fillers) so that every id decodes to text. Random weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = specials + list(dict.fromkeys(words)) + [f"w{i}" for i in range(32000)]
    vocab = {w: i for i, w in enumerate(words[:32000])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    model = bench_llama_56m().to(getattr(torch, dtype))
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts_for(n: int, length: int, seed: int = 1, vocab_size: int = 32000) -> list[list[int]]:
    """Random prompts over the vocabulary, clear of the first ids (where special tokens usually sit)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab_size // 2), vocab_size, (n, length), generator=g).tolist()




def run_hf_generate(model, prompts, output_len: int, streamer=None) -> Row:
    """transformers' `generate`, one request after another, exactly `output_len` greedy tokens each;
    `streamer` (a `generate` streamer) sees every request's prompt and tokens."""
    model.set_attn_implementation("sdpa")  # a ModelRunner over this model switched it to cell_gather
    clock, n = Clock(), 0
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0, streamer=streamer)
            n += out.shape[1] - len(p)
    return Row("transformers generate (sequential)", 1, n, *clock.lap())
