"""LLM: the offline batch API over the same Engine the server drives.

    from engine import LLM, SamplingParams
    llm = LLM()                      # the bundled default model (or a folder, a .gguf, a known name)
    outs = llm.generate(["ROMEO:"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)
"""

from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from engine.api.args import EngineArgs
from engine.api.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.core.engine import Engine
from engine.model.runner import ModelRunner


@dataclass
class LLMOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # accumulated over the whole generation
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked for them


class LLM:
    """Runs many prompts to completion with continuous batching; returns outputs in prompt order."""

    def __init__(self, model: str | Path | None = None, *, runner: ModelRunner | None = None, **engine_args):
        """`model`: a folder, a .gguf file, a known name or None (the bundled model); `engine_args`: any
        `EngineArgs` field (n_cells, dtype, threads, ...). Offline, nothing is ever refused for a full
        queue: every prompt given to `generate` is queued."""
        engine_args.setdefault("max_queue", 1 << 30)
        self.engine = Engine.from_args(EngineArgs(model=model, **engine_args), runner)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[LLMOutput]:
        """`prompts`: strings or token-id lists. One SamplingParams for all, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams: give one or one each")
        results = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            out = LLMOutput(str(i), prompt if isinstance(prompt, str) else None, ids,
                            [CompletionOutput(k) for k in range(p.n)])
            self.engine.add_request(str(i), ids, p, _accumulator(out))
            results.append(out)
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req")
        done = 0
        while self.engine.has_unfinished():
            finished = sum(o.finished for o in self.engine.step())
            done += finished
            bar.update(finished)
        bar.close()
        return results


def _accumulator(out: LLMOutput):
    def emit(delta: RequestOutput) -> None:
        out.prompt_logprobs = delta.prompt_logprobs or out.prompt_logprobs
        for c in delta.outputs:
            acc = out.outputs[c.index]
            acc.token_ids += c.token_ids
            acc.text += c.text
            if c.logprobs:
                acc.logprobs = (acc.logprobs or []) + c.logprobs
            acc.finish_reason = c.finish_reason or acc.finish_reason
            acc.stop_reason = c.stop_reason if c.stop_reason is not None else acc.stop_reason

    return emit
