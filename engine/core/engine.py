"""Engine: one tick = one forward over every runnable sequence's tokens on one flat axis.

The synchronous core. `step()` schedules a flat step (`Scheduler`), runs the model over the shared
cells (`ModelRunner`), samples every row that needs a token (`Sampler`), and turns the tokens into
`RequestOutput` deltas for each request's `emit` callback (`OutputProcessor`). Commands (add, fork,
cancel, delete, truncate) are plain method calls made between steps: admission rules live in
`engine.core.admission`, the persistent-sequence verbs in `engine.core.sequence_verbs` (their work in
`engine.core.persistent`), what the engine reports (limits, stats, memory) in `engine.core.engine_reports`.
`AsyncEngine` (engine/core/async_engine.py) runs this on a thread and queues the commands to the step boundary.
"""

import functools
import logging
import time

import torch

from engine.api.args import EngineArgs
from engine.api.ids import new_id
from engine.api.lora import AdapterInfo
from engine.api.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    TokenLogprob,
)
from engine.api.sampling_params import SamplingParams
from engine.core.adapters import Adapters
from engine.core.admission import Admission
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.embedding import Pooler, check_embeddings, embed, new_embedding
from engine.core.engine_reports import EngineReports
from engine.core.memory import MemoryAccount
from engine.core.output_processor import OutputProcessor
from engine.core.persistent import SequenceTable
from engine.core.plan import Chunk, ModelOutput, SchedulerOutput, flatten
from engine.core.prompt_logprobs import take_prompt_logprobs
from engine.core.scheduler import Scheduler
from engine.core.sequence import Choice, Request, Sequence
from engine.core.sequence_verbs import SequenceVerbs
from engine.core.state.identity import identity_of
from engine.core.state.store import DurableStore
from engine.loader.source import resolve_args, resolve_model
from engine.model.runner import ModelRunner
from engine.sample.sampler import Sampler, make_generator
from engine.spec.decoder import SpeculativeDecoder
from engine.spec.draft_model import DraftModel, check_same_vocabulary

log = logging.getLogger("cellserve.engine")
# the prefill a loaded model warms up with (capped by max_num_batched_tokens): past the quantized kernels'
# switch to bf16 tiles (engine/model/native/quant.py: BF16_ROWS, TILED_BF16_ROWS), so both paths have run once
WARMUP_PREFILL = 256


class Engine(SequenceVerbs, EngineReports):
    """Continuous batching over one cell pool. Not thread-safe: one caller (or the AsyncEngine loop).

    Guarantees: a request that can never fit is refused at `add_request`; one failing forward
    fails only the requests in that step; when every request has finished, been cancelled or
    deleted, the pool's free cells return to their baseline (only idle persistent sequences keep
    cells, and only until deleted, expired or evicted).
    """

    def __init__(self, runner: ModelRunner, config: EngineArgs | None = None, draft: ModelRunner | None = None):
        """`draft`: the draft model's runner (`EngineArgs.draft_model` loaded; speculative decoding on)."""
        self.runner = runner
        self.config = config or EngineArgs()
        self.cache = runner.cache
        self.tokenizer = runner.tokenizer
        cfg = self.config
        if draft is not None and cfg.speculative not in ("auto", "ngram"):
            raise ValueError("a draft model drafts only with speculative 'auto' or 'ngram'")
        self.sampler = Sampler()
        drafter = self._drafter(draft)
        identity = functools.cache(lambda: identity_of(runner))
        started = time.perf_counter()
        store = DurableStore(cfg.state_dir, identity(), cfg.state_max_bytes) if cfg.state_dir is not None else None
        self.scheduler = Scheduler(self.cache, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   prefix_caching=cfg.prefix_caching, prefill_while_decoding=cfg.prefill_while_decoding,
                                   prefill_backlog_ticks=cfg.prefill_backlog_ticks, store=store, mirror=drafter)
        self.requests: dict[str, Request] = {}
        self.eos_ids = _eos_ids(runner)
        self.vocab_size = runner.config.get_text_config().vocab_size
        self.persistent = SequenceTable(self.scheduler, store, identity)
        if store is not None:
            _restore(self.persistent, cfg, self.vocab_size, started)
        self.admission = Admission(runner.max_model_len, self.cache.n_cells, self.config.max_queue,
                                   self.vocab_size, self.tokenizer, self.eos_ids, self.config.grammar_timeout_s)
        self.outputs = OutputProcessor(self.scheduler, self.requests, self.eos_ids)
        self.pooler = Pooler(runner.logits_of)
        self.adapters = Adapters(runner.loras, self.scheduler, self.requests, cfg.max_loras, cfg.max_lora_memory)
        self.speculative = None
        if cfg.speculative in ("auto", "ngram"):
            self.speculative = SpeculativeDecoder(self.scheduler.queues, self.sampler, cfg.num_speculative_tokens,
                                                  runner.max_model_len, always=cfg.speculative == "ngram",
                                                  persistent=self.persistent.by_id.get, drafter=drafter)
        self.steps = self.generated_tokens = self.prompt_tokens = 0
        self.memory_account = MemoryAccount([runner] + ([draft] if draft is not None else []),
                                            cfg.max_num_batched_tokens, grammar=self.admission.grammar_cache_bytes,
                                            prefix=self.scheduler.prefix.footprint,
                                            adapters=lambda: sum(a.nbytes for a in self.adapters.infos()))

    @classmethod
    def from_args(cls, args: EngineArgs, runner: ModelRunner | None = None) -> "Engine":
        """The one way to build an engine: from `args` (loading the model unless a ready `ModelRunner`
        is given). `LLM`, `AsyncEngine` and the benchmarks all come here."""
        if runner is None:
            args, _ = resolve_args(args)
            runner = ModelRunner.from_pretrained(args.model, dtype=args.dtype, quantize=args.quantize,
                                                 **args.runner_kwargs())
            if args.warmup:  # before the engine: the pool is still empty (no restored sequence yet)
                runner.warm_up(min(WARMUP_PREFILL, args.max_num_batched_tokens), args.num_speculative_tokens)
        engine = cls._build(runner, args)
        for name, path in args.lora_modules.items():  # --lora NAME=PATH, in their order (llama.cpp's ids 0, 1, ...)
            engine.adapters.load(name, path)
        return engine

    @classmethod
    def _build(cls, runner: ModelRunner, args: EngineArgs) -> "Engine":
        draft = None
        if args.draft_model is not None:  # its own pool: as many cells and slots as the target's
            draft = ModelRunner.from_pretrained(resolve_model(args.draft_model, args.draft_dtype).path,
                                                dtype=args.draft_dtype, **{**args.runner_kwargs(), "n_cells": runner.n_cells})
            if args.warmup:  # its steps: a catch-up prefill, then one row a step
                draft.warm_up(min(WARMUP_PREFILL, args.max_num_batched_tokens), 0)
        return cls(runner, args, draft)

    # ----- requests --------------------------------------------------------------------------
    def add_request(self, request_id, prompt_ids, params: SamplingParams, emit=None, seq_id=None, *,
                    detokenize: bool = True) -> Request:
        """Queue a generation. With `seq_id`, `prompt_ids` are appended to that persistent sequence
        and the output stays in it. Raises (changing nothing) if it cannot be served.

        `detokenize=False` leaves every output's `text` empty, for a consumer that decodes the tokens
        itself off this thread (`OutputDetokenizer`); refused with stop strings, which must end the
        generation here, before the next token is sampled."""
        seq = self.persistent.get(seq_id) if seq_id is not None else None
        grammar = self.admission.admit(request_id, prompt_ids, params, seq, in_flight=self.requests,
                                       n_waiting=len(self.scheduler.waiting), detokenize=detokenize)
        req = Request(request_id, list(prompt_ids), params, emit or (lambda out: None), detokenize=detokenize,
                      grammar=grammar)
        if params.prompt_logprobs is not None:  # the first token has no logprob: nothing predicts it
            req.prompt_logprobs = PromptLogprobs(list(prompt_ids[:1]), [None], [None])
        lora = self.adapters.bind(params.lora, seq)
        if seq is None:
            seq = Sequence(new_id("gen"), list(prompt_ids), lora=lora)
        else:
            self.adapters.rebind(seq, lora)
            seq.token_ids.extend(prompt_ids)
            req.persistent_seq = seq
        self._start(req, seq, 0)
        req.children_pending = params.n - 1
        self.requests[request_id] = req
        self.prompt_tokens += len(prompt_ids)
        return req

    def embed(self, prompts: list[list[int]], pooling: str, score_tokens: list[int] | None = None) -> list[list[float]]:
        """Pooled, unit-length final hidden states of each prompt (or its last-token logits of `score_tokens`),
        stepping until they are made (a synchronous caller's way; `add_embedding` queues one)."""
        return embed(self, prompts, pooling, score_tokens)

    def add_embedding(self, request_id: str, prompt_ids: list[int], pooling: str, emit,
                      score_tokens: list[int] | None = None) -> Request:
        """Queue an embedding of `prompt_ids` (engine/core/embedding.py): its rows run in the flat step, and its
        last output carries the vector (with `score_tokens`: the last row's logits of those tokens). Raises
        (changing nothing) if it cannot be served."""
        check_embeddings(self, [prompt_ids], pooling, score_tokens)
        req, seq = new_embedding(request_id, prompt_ids, pooling, emit, score_tokens)
        self._start(req, seq, 0)
        self.requests[request_id] = req
        self.prompt_tokens += len(prompt_ids)
        return req

    def cancel(self, request_id: str) -> bool:
        """Stop a request now; its cells are released. Unknown or finished ids are harmless."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._settle([self.outputs.cancel(req)])
        return True

    def cancel_all(self) -> None:
        """Cancel every request in flight (a shutdown's leftovers, or after a tick that failed outside the forward)."""
        for request_id in list(self.requests):
            self.cancel(request_id)

    def abandon(self, why: str) -> None:
        """The engine cannot go on: send every in-flight request a last output with `why` as each choice's error,
        changing nothing else (best effort: a failing `emit` is logged and skipped)."""
        for request_id, req in list(self.requests.items()):
            out = RequestOutput(request_id, [CompletionOutput(i, finish_reason="error", error=why)
                                             for i in range(req.params.n)], req.prompt_ids, True)
            try:
                req.emit(out)
            except Exception:
                log.exception("could not fail request %s", request_id)

    def context_ids(self, request_id: str) -> list[int]:
        """The tokens an in-flight request's output follows: its prompt, after the history of the sequence it continues."""
        return list(self.requests[request_id].choices[0].seq.token_ids)

    # ----- the tick --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One tick as data handed along (vLLM v1's loop): the scheduler's plan -> the model's output for it
        -> one update that applies it. Returns the tick's outputs."""
        drafts = self.speculative.propose() if self.speculative is not None else {}
        plan = self.scheduler.schedule(drafts)
        outputs = self.outputs.scheduled(plan)
        if plan.chunks:
            started = time.perf_counter()
            result = self._execute(plan, outputs)
            if result is not None:
                self._update(plan, result, outputs)
                self._observe_cost(plan.chunks, time.perf_counter() - started)
        return self._settle(outputs)

    def _execute(self, plan: SchedulerOutput, outputs: list[RequestOutput]) -> ModelOutput | None:
        """The forward over the plan's flat step, its logits split by row kind; None if it failed (then its
        requests failed: one bad step fails its requests, never the engine)."""
        try:
            logits, hidden = self.runner.forward_hidden(flatten(plan))
        except Exception as exc:
            log.exception("forward failed; failing the %d sequences of this step", len(plan.chunks))
            self.outputs.fail_step(plan.chunks, exc, outputs)
            return None
        self.steps += 1
        return ModelOutput.split(plan, logits, hidden)

    def _update(self, plan: SchedulerOutput, result: ModelOutput, outputs: list[RequestOutput]) -> None:
        """Apply a forward's output: cached counts, prompt logprobs, sampled and verified tokens (finishes
        included), drafted cells kept or dropped; then each request's delta of the tick."""
        self.scheduler.advance(plan.chunks)
        self.outputs.progress(plan.chunks, outputs)
        if plan.prompt_rows:  # echo, lm-eval
            self._take_prompt_logprobs(plan.chunks, plan.prompt_rows, result.prompt, outputs)
        if plan.pooling:  # embeddings: their rows' hidden states pooled; a complete one ends with its vector
            for req, vector in self.pooler.take(plan, result.hidden):
                self.outputs.finish(req.choices[0], "stop")
                outputs.append(self.outputs.emit(req, {}, embedding=vector))
        if plan.sampling:
            news: dict[Request, dict] = {}
            try:
                self._sample(plan.plain, result.plain, news, outputs)
                self.generated_tokens += self._verify(plan.drafted, result.drafted, news)
            except Exception as exc:  # a sampling/detok bug fails the rows that sampled, not everyone
                log.exception("sampling failed; failing the %d sequences that sampled", len(plan.sampling))
                news.clear()
                self.outputs.fail_step(plan.sampling, exc, outputs)
            for req, choices in news.items():
                outputs.append(self.outputs.emit(req, choices))
        self.outputs.finish_prefills(outputs)

    def _verify(self, chunks: list[Chunk], logits: torch.Tensor, news: dict) -> int:
        """Drafted chunks (1 + len(draft) rows each, in order): each one's verified tokens appended until one
        ends its choice, the outcome counted, the cells of drafted tokens not kept dropped. Returns the tokens
        appended."""
        at = appended = 0
        for c in chunks:
            rows, at = logits[at : at + 1 + len(c.draft)], at + 1 + len(c.draft)
            choice = c.seq.choice
            if choice is None or choice.request.finished:
                continue
            verified = self.speculative.verify(c, rows)
            kept = self.outputs.append_kept(choice, verified.tokens, verified.logprobs,
                                            news.setdefault(choice.request, {}))
            drafts_kept = self.speculative.record(c, verified, kept)
            self.outputs.count_drafts(choice.request, drafts_kept, len(c.draft) - drafts_kept)
            self.scheduler.settle_draft(c.seq, c.start + 1 + drafts_kept, c.start + 1 + len(c.draft))
            appended += kept
        return appended

    # ----- internals -------------------------------------------------------------------------
    def _observe_cost(self, chunks: list[Chunk], seconds: float) -> None:
        """A decode-only step's time by its row count, its forward and its sampling (a verification samples
        every drafted row): what tells "auto" how long a draft pays here."""
        if self.speculative is not None and all(c.n_tokens == 1 for c in chunks):
            self.speculative.costs.observe(sum(1 + len(c.draft) for c in chunks), seconds)

    def _drafter(self, draft: ModelRunner | None) -> DraftModel | None:
        """The draft model's driver; its pool follows the scheduler's cells (the scheduler's `mirror`)."""
        if draft is None:
            return None
        check_same_vocabulary(self.runner, draft, str(self.config.draft_model or "given"))
        if draft.cache.max_seqs != self.cache.max_seqs:
            raise ValueError(f"the draft pool has {draft.cache.max_seqs} slots and the target's {self.cache.max_seqs}: "
                             f"build both runners with the same max_seqs")
        return DraftModel(draft, self.sampler, self.config.max_num_batched_tokens)

    def _settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Requests on persistent sequences that ended this tick: the sequences go to the state dir (if any)
        before their last output leaves the engine, so an acknowledged generation survives a crash."""
        if self.speculative is not None:
            self.speculative.settle()
        for out in outputs:
            if out.finished and out.seq_id is not None:
                self.persistent.settled(out.seq_id)
        return outputs

    def _start(self, req: Request, seq: Sequence, index: int) -> None:
        """Choice `index` of `req` generates on `seq` (queued: it runs when scheduled)."""
        params = req.params.for_child(index) if index else req.params
        detok = None
        if self.tokenizer is not None and not req.prefill_only and req.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, stop=req.params.stop,
                                           skip_special_tokens=req.params.skip_special_tokens,
                                           min_tokens=req.params.min_tokens)
        choice = Choice(req, seq, index, len(seq.token_ids), params,
                        None if params.greedy else make_generator(params), detok,
                        self.admission.grammar_state(req.grammar) if req.grammar is not None else None)
        req.choices.append(choice)
        self.scheduler.start(seq, choice)

    def _take_prompt_logprobs(self, chunks: list[Chunk], prompt_rows: dict[int, int], logits, outputs) -> None:
        lp_chunks = [c for c in chunks if id(c) in prompt_rows]
        try:
            take_prompt_logprobs(lp_chunks, prompt_rows, logits)
        except Exception as exc:
            log.exception("prompt logprobs failed; failing the %d sequences that asked", len(lp_chunks))
            self.outputs.fail_step(lp_chunks, exc, outputs)

    def _sample(self, chunks: list[Chunk], logits, news: dict, outputs) -> None:
        """One token per chunk (and per child of an n > 1 request), into `news` (request -> choices)."""
        if not chunks:
            return
        rows, seqs = [], []
        for i, c in enumerate(chunks):
            for seq in [c.seq, *self._spawn_children(c.seq)]:
                rows.append(i)
                seqs.append(seq)
        # Token histories are only read for penalties: don't copy them for every row every step.
        choices = [s.choice for s in seqs]
        pen = [c.params.has_penalties for c in choices]
        if rows != list(range(len(logits))):  # n > 1 children reuse their parent's row
            logits = logits[rows]
        result = self.sampler(logits, [c.params for c in choices], [c.generator for c in choices],
                              [c.output_ids if p else [] for c, p in zip(choices, pen)],
                              [c.history if p else [] for c, p in zip(choices, pen)],
                              [c.grammar for c in choices])
        for k, choice in enumerate(choices):
            req = choice.request
            if not choice.live or req.finished:  # an earlier row of its request failed it
                continue
            lp = None
            if result.logprobs[k] is not None:
                lp = TokenLogprob(result.token_ids[k], result.logprobs[k], result.top_logprobs[k] or [])
            try:
                news.setdefault(req, {})[choice.index] = self.outputs.append(choice, result.token_ids[k], lp)
            except Exception as exc:  # e.g. a detokenizer bug on one request's text: fail it alone
                log.exception("request %s failed while taking its token; failing it alone", req.request_id)
                news.pop(req, None)
                self.outputs.fail_request(req, exc, outputs)
        self.generated_tokens += len(seqs)

    def _spawn_children(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was prefilled once; fork n-1 children that share its cells."""
        req = parent.request
        if not req.children_pending:
            return []
        children = []
        for i in range(1, req.children_pending + 1):
            child = Sequence(new_id("gen"), list(parent.token_ids), lora=parent.lora)
            self._start(req, child, i)
            self.scheduler.start_child(parent, child)
            children.append(child)
        req.children_pending = 0
        return children

    # ----- LoRA adapters (engine.core.adapters) -------------------------------------------------
    def load_lora(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """`Adapters.load`: between steps (the caller's loop thread)."""
        return self.adapters.load(name, path, replace)

    def unload_lora(self, name: str) -> AdapterInfo:
        """`Adapters.unload`: between steps."""
        return self.adapters.unload(name)

    def lora_adapters(self) -> list[AdapterInfo]:
        """The loaded adapters (a snapshot list, safe from any thread)."""
        return self.adapters.infos()


def _restore(table: SequenceTable, cfg: EngineArgs, vocab_size: int, started: float) -> None:
    """With `state_dir`: the persistent sequences saved there come back (their cells at once with `state_eager`,
    else when each is scheduled: `Scheduler.page_in`)."""
    n_seqs, n_cells = table.restore(vocab_size, eager=cfg.state_eager)
    log.info("state dir %s: restored %d sequences in %.2f s (%s)", cfg.state_dir, n_seqs, time.perf_counter() - started,
             f"{n_cells} tokens with their saved cells loaded" if cfg.state_eager else "cells load when each is used")


def _eos_ids(runner: ModelRunner) -> list[int]:
    ids: set[int] = set()
    gen = getattr(runner.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(runner.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)
