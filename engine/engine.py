"""Engine: one tick = one forward over every runnable sequence's tokens on one flat axis.

The synchronous core. `step()` schedules a flat step, runs the model over the shared cells,
samples every row that needs a token, detokenizes, and hands `RequestOutput` deltas to each
request's `emit` callback. Commands (add, fork, cancel, delete, truncate) are plain method calls
made between steps; `AsyncEngine` (engine/async_engine.py) runs this on a thread and queues the
commands to the step boundary.
"""

import logging
import threading
import time

import torch

from engine.args import EngineArgs
from engine.detok import IncrementalDetokenizer
from engine.errors import InvalidRequest, PromptTooLong, QueueFull, SequenceBusy, SequenceNotFound
from engine.ids import new_id
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    PromptLogprobs,
    RequestOutput,
    SequenceInfo,
    TokenLogprob,
)
from engine.prompt_logprobs import ScoredSequence, take_prompt_logprobs
from engine.prompt_logprobs import prompt_rows as plp_rows
from engine.runner import ModelRunner
from engine.sampling import Sampler, SamplingParams, check_stop_token, make_generator
from engine.scheduler import Chunk, Scheduler
from engine.sequence import Request, SeqStatus, Sequence
from engine.step import FlatStep, flatten_step

log = logging.getLogger("cellserve.engine")


EngineConfig = EngineArgs  # the engine's limits are the EngineArgs fields (one source of each default)


class Engine:
    """Continuous batching over one cell pool. Not thread-safe: one caller (or the AsyncEngine loop).

    Guarantees: a request that can never fit is refused at `add_request`; one failing forward
    fails only the requests in that step; when every request has finished, been cancelled or
    deleted, the pool's free cells return to their baseline (only idle persistent sequences keep
    cells, and only until deleted, expired or evicted).
    """

    def __init__(self, runner: ModelRunner, config: EngineArgs | None = None):
        self.runner = runner
        self.config = config or EngineArgs()
        self.cache = runner.cache
        self.tokenizer = runner.tokenizer
        self.scheduler = Scheduler(self.cache, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   prefix_caching=self.config.prefix_caching)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.sequences: dict[str, Sequence] = {}  # persistent sequences by id
        self.eos_ids = _eos_ids(runner)
        self.vocab_size = runner.config.get_text_config().vocab_size
        self.steps = self.generated_tokens = self.prompt_tokens = 0
        self._grammars = None  # engine.grammar.GrammarCompiler, made on the first structured-output request
        self._grammars_lock = threading.Lock()

    # ----- requests --------------------------------------------------------------------------
    def add_request(self, request_id, prompt_ids, params: SamplingParams, emit=None, seq_id=None, *,
                    detokenize: bool = True) -> Request:
        """Queue a generation. With `seq_id`, `prompt_ids` are appended to that persistent sequence
        and the output stays in it. Raises (changing nothing) if it cannot be served.

        `detokenize=False` leaves every output's `text` empty, for a consumer that decodes the tokens
        itself off this thread (`OutputDetokenizer`); refused with stop strings, which must end the
        generation here, before the next token is sampled."""
        if not detokenize and params.stop:
            raise InvalidRequest("stop strings need the engine's detokenizer: keep detokenize=True", "stop")
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in flight", "request_id")
        seq = self._persistent(seq_id) if seq_id is not None else None
        if seq is not None and seq.request is not None:
            raise SequenceBusy(f"sequence {seq_id} is already generating; wait or cancel it")
        if seq is not None and params.n != 1:
            raise InvalidRequest("n must be 1 when continuing a sequence; fork it for more branches", "n")
        history = len(seq.token_ids) if seq else 0
        if history + len(prompt_ids) == 0:
            raise InvalidRequest("the prompt is empty: give at least one token", "prompt")
        self._check_tokens(prompt_ids)
        params.check_vocab(self.vocab_size)
        grammar = self.compile_grammar(params)
        if params.prompt_logprobs is not None and seq is not None:
            raise InvalidRequest("prompt logprobs need the whole prompt computed; a sequence continuation reuses "
                                 "its cached history: send the text as a new prompt", "prompt_logprobs")
        self.check_fits([history + len(prompt_ids)], params.max_tokens, params.n)
        self._check_queue()
        # max_tokens 0 asks for no token (SamplingParams' contract): the prompt is cached, nothing sampled.
        req = Request(request_id, list(prompt_ids), params, emit or (lambda out: None),
                      prefill_only=params.max_tokens == 0, detokenize=detokenize)
        req.grammar = grammar
        if params.prompt_logprobs is not None:  # the first token has no logprob: nothing predicts it
            req.prompt_logprobs = PromptLogprobs(list(prompt_ids[:1]), [None], [None])
        if seq is None:
            seq = (ScoredSequence if req.prompt_logprobs is not None else Sequence)(new_id("gen"), list(prompt_ids))
        else:
            seq.token_ids.extend(prompt_ids)
            req.persistent_seq = seq
        self._start(req, seq, 0)
        req.children_pending = params.n - 1
        self.requests[request_id] = req
        self.prompt_tokens += len(prompt_ids)
        return req

    def create_sequence(self, prompt_ids, emit=None) -> tuple[Sequence, Request]:
        """A new persistent sequence, prefilled as soon as it is scheduled (a max_tokens=0 request on it)."""
        seq = Sequence(new_id("seq"), [], persistent=True)
        self.sequences[seq.seq_id] = seq
        try:
            req = self.add_request(new_id("prefill"), prompt_ids, SamplingParams(max_tokens=0), emit, seq.seq_id)
        except Exception:
            del self.sequences[seq.seq_id]  # refused: nothing was created
            raise
        return seq, req

    def cancel(self, request_id: str) -> bool:
        """Stop a request now; its cells are released. Unknown or finished ids are harmless."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.live():
            self._finish_seq(seq, "cancelled")
        self._emit(req, {})
        return True

    # ----- persistent sequences --------------------------------------------------------------
    def fork(self, seq_id: str, at: int | None = None) -> Sequence:
        """A new persistent sequence sharing `seq_id`'s first `at` tokens (all if None) and their cells."""
        parent = self._persistent(seq_id)
        at = len(parent.token_ids) if at is None else at
        if not 1 <= at <= len(parent.token_ids):
            raise InvalidRequest(f"fork at={at} is outside [1, {len(parent.token_ids)}]", "at")
        child = Sequence(new_id("seq"), parent.token_ids[:at], persistent=True, parent=seq_id)
        share = min(parent.n_cached, at - 1)
        if parent.slot is not None and share > 0 and self.scheduler.acquire_slot(child, keep=parent):
            self.scheduler.share(parent, child, share)
        self.sequences[child.seq_id] = child
        return child

    def truncate(self, seq_id: str, length: int) -> Sequence:
        seq = self._persistent(seq_id)
        if seq.request is not None:
            raise SequenceBusy(f"sequence {seq_id} is generating; cancel it before truncating")
        if not 1 <= length <= len(seq.token_ids):
            raise InvalidRequest(f"length={length} is outside [1, {len(seq.token_ids)}]", "length")
        if seq.n_cached > length - 1:
            self.scheduler.uncache(seq, length - 1)
        del seq.token_ids[length:]
        seq.last_used = time.monotonic()
        return seq

    def delete(self, seq_id: str) -> None:
        seq = self._persistent(seq_id)
        if seq.request is not None:
            self.cancel(seq.request.request_id)
        self.scheduler.release(seq)
        del self.sequences[seq_id]

    def sequence_info(self, seq_id: str) -> SequenceInfo:
        seq = self._persistent(seq_id)
        owned = self.cache.seq_len(seq.slot) if seq.slot is not None else 0
        shared = self.cache.shared_cells(seq.slot) if seq.slot is not None else 0
        return SequenceInfo(seq.seq_id, len(seq.token_ids), list(seq.token_ids), seq.status.value, seq.parent,
                            seq.n_cached, owned, shared, seq.created, seq.last_used)

    # ----- the tick --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one tick; return the outputs emitted during it."""
        outputs: list[RequestOutput] = []
        chunks = self.scheduler.schedule()
        self._finish_idle_prefills(outputs)
        if not chunks:
            return outputs
        sample_chunks = [c for c in chunks if c.completes and c.seq.wants_logits]
        prompt_rows = plp_rows(chunks)
        flat = _flatten(chunks, sample_chunks, prompt_rows)
        try:
            logits = self.runner.forward(*flat)
        except Exception as exc:  # one bad step fails its requests, never the engine
            log.exception("forward failed; failing the %d sequences of this step", len(chunks))
            self._fail_step(chunks, exc, outputs)
            return outputs
        self.steps += 1
        for c in chunks:
            self.scheduler.set_cached(c.seq, c.seq.n_cached + c.n_tokens)
            c.seq.last_used = time.monotonic()
        if prompt_rows:  # rows after the sampling ones: prompt logprobs (echo, lm-eval)
            lp_chunks = [c for c in chunks if id(c) in prompt_rows]
            try:
                take_prompt_logprobs(lp_chunks, prompt_rows, logits[len(sample_chunks):])
            except Exception as exc:
                log.exception("prompt logprobs failed; failing the %d sequences that asked", len(lp_chunks))
                self._fail_step(lp_chunks, exc, outputs)
            logits = logits[: len(sample_chunks)]
        if sample_chunks:
            try:
                self._sample(sample_chunks, logits, outputs)
            except Exception as exc:  # a sampling/detok bug fails the rows that sampled, not everyone
                log.exception("sampling failed; failing the %d sequences that sampled", len(sample_chunks))
                self._fail_step(sample_chunks, exc, outputs)
        self._finish_idle_prefills(outputs)
        return outputs

    # ----- internals -------------------------------------------------------------------------
    def _start(self, req: Request, seq: Sequence, index: int) -> None:
        seq.request, seq.index, seq.gen_start = req, index, len(seq.token_ids)
        seq.finish_reason = seq.error = None
        seq.params = req.params.for_child(index) if index else req.params
        seq.generator = None if seq.params.greedy else make_generator(seq.params)
        seq.detok = None
        seq.grammar = self._grammars.state(req.grammar) if req.grammar is not None else None
        if self.tokenizer is not None and not req.prefill_only and req.detokenize:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, stop=req.params.stop)
        req.seqs.append(seq)
        self.scheduler.remove(seq)
        self.scheduler.enqueue(seq)

    def _sample(self, chunks: list[Chunk], logits, outputs) -> None:
        rows, seqs = [], []
        for i, c in enumerate(chunks):
            for seq in [c.seq, *self._spawn_children(c.seq)]:
                rows.append(i)
                seqs.append(seq)
        # Token histories are only read for penalties: don't copy them for every row every step.
        pen = [s.params.has_penalties for s in seqs]
        if rows != list(range(len(logits))):  # n > 1 children reuse their parent's row
            logits = logits[rows]
        result = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                              [s.output_ids if p else [] for s, p in zip(seqs, pen)],
                              [s.token_ids[: s.gen_start] if p else [] for s, p in zip(seqs, pen)],
                              [s.grammar for s in seqs])
        news: dict[Request, dict[int, CompletionOutput]] = {}
        for k, seq in enumerate(seqs):
            req = seq.request  # _append may finish the sequence and clear it
            if req is None or req.finished:  # an earlier row of its request failed it
                continue
            lp = None
            if result.logprobs[k] is not None:
                lp = TokenLogprob(result.token_ids[k], result.logprobs[k], result.top_logprobs[k] or [])
            try:
                news.setdefault(req, {})[seq.index] = self._append(seq, result.token_ids[k], lp)
            except Exception as exc:  # e.g. a detokenizer bug on one request's text: fail it alone
                log.exception("request %s failed while taking its token; failing it alone", req.request_id)
                news.pop(req, None)
                self._fail_request(req, exc, outputs)
        self.generated_tokens += len(seqs)
        for req, choices in news.items():
            outputs.append(self._emit(req, choices))

    def _spawn_children(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was prefilled once; fork n-1 children that share its cells."""
        req = parent.request
        if not req.children_pending:
            return []
        children = []
        for i in range(1, req.children_pending + 1):
            child = Sequence(new_id("gen"), list(parent.token_ids))
            self._start(req, child, i)
            if self.scheduler.acquire_slot(child):
                self.scheduler.share(parent, child, parent.n_cached)
                self.scheduler.remove(child)
                self.scheduler.add_running(child)
            children.append(child)
        req.children_pending = 0
        return children

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> CompletionOutput:
        req = seq.request
        seq.token_ids.append(token)
        if req.timing.first_token is None:
            req.timing.first_token = time.monotonic()
        out = CompletionOutput(seq.index, [token], logprobs=[lp] if lp else None)
        stop = check_stop_token(seq.params, token, seq.num_generated, self.eos_ids)
        if seq.grammar is not None:
            seq.grammar.accept(token)
            if seq.grammar.terminated:  # the grammar was complete and took EOS: the choice is done
                stop = ("stop", None)
        if seq.detok is not None:
            if stop is None or stop[0] != "stop":  # EOS and stop-token ids carry no text
                out.text = seq.detok.push(token)
            if seq.detok.stopped:
                stop = ("stop", seq.detok.stop_reason)
            elif stop is not None:
                out.text += seq.detok.flush()
        if stop is not None:
            out.finish_reason, out.stop_reason = stop
            self._finish_seq(seq, stop[0])
        return out

    def _emit(self, req: Request, choices: dict[int, CompletionOutput]) -> RequestOutput:
        for seq in req.seqs:
            if seq.index not in choices and seq.request is None and seq.index not in req.reported:
                choices[seq.index] = CompletionOutput(seq.index, finish_reason=seq.finish_reason, error=seq.error)
        if req.children_pending and not req.live():
            _end_unforked(req, choices)
        req.reported.update(i for i, c in choices.items() if c.finish_reason)
        finished = not req.live()
        if finished and not req.finished:
            req.finished = True
            req.timing.finished = time.monotonic()
            self.requests.pop(req.request_id, None)
        seq_id = req.persistent_seq.seq_id if req.persistent_seq else None
        plp = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            plp, req.prompt_logprobs_sent = req.prompt_logprobs, True
        out = RequestOutput(req.request_id, sorted(choices.values(), key=lambda c: c.index), req.prompt_ids,
                            finished, seq_id, req.timing, req.num_generated, req.cached_tokens or 0,
                            prompt_logprobs=plp)
        req.emit(out)
        return out

    def _finish_seq(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason, seq.error = reason, error
        seq.request = seq.grammar = None
        self.scheduler.remove(seq)
        if seq.persistent:
            seq.status = SeqStatus.IDLE
            seq.last_used = time.monotonic()
            if seq.n_cached > len(seq.token_ids) - 1:  # keep the last token uncached (see Sequence)
                self.scheduler.uncache(seq, len(seq.token_ids) - 1)
        elif reason == "error":  # cells of a failed step are not trusted as a cached prefix
            self.scheduler.release(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self.scheduler.retire(seq)

    def _finish_idle_prefills(self, outputs) -> None:
        """Prefill-only requests (sequence create, max_tokens 0) end once their cache target is reached,
        with finish_reason `length`: they have generated all max_tokens = 0 of their tokens."""
        for seq in list(self.scheduler.running):
            req = seq.request
            if req is not None and req.prefill_only and seq.n_cached >= seq.cache_target():
                self._finish_seq(seq, "length")
                outputs.append(self._emit(req, {}))

    def _fail_step(self, chunks: list[Chunk], exc: Exception, outputs) -> None:
        failed = {c.seq.request for c in chunks if c.seq.request is not None}
        log.error("failing requests %s: %s: %s", sorted(r.request_id for r in failed), type(exc).__name__, exc)
        for req in failed:
            self._fail_request(req, exc, outputs)

    def _fail_request(self, req: Request, exc: Exception, outputs) -> None:
        for seq in req.live():
            self._finish_seq(seq, "error", f"{type(exc).__name__}: {exc}")
        outputs.append(self._emit(req, {}))

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured-output request (None without one), or InvalidRequest naming
        its field. Thread-safe: the HTTP layer calls it from a worker thread before submitting, so a compile
        (milliseconds; more for a big schema) does not stall the tick, and admission hits xgrammar's cache."""
        if params.guided is None or not params.max_tokens:
            return None
        if self.tokenizer is None:
            raise InvalidRequest("structured output needs the model's tokenizer, which this engine has not "
                                 "loaded", params.guided.param)
        with self._grammars_lock:
            if self._grammars is None:  # xgrammar loads only when structured output is used
                from engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars.compile(params.guided)

    def _persistent(self, seq_id: str) -> Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise SequenceNotFound(f"no sequence {seq_id!r}: it was deleted, expired, or never existed")
        return seq

    def _check_tokens(self, ids) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", "prompt")

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int:
        """The most tokens each of n choices can generate after `prompt_len` tokens: the model's context
        left, and the pool shared by the n choices (the same rule `check_fits` enforces); at least 1."""
        by_model = self.runner.max_model_len - prompt_len
        by_pool = (self.cache.n_cells - prompt_len) // max(1, n)
        return max(1, min(by_model, by_pool))

    def check_fits(self, prompt_lens: list[int], max_tokens: int, n: int = 1) -> None:
        """Refuse (PromptTooLong, changing nothing) what can never run: a prompt + max_tokens beyond the
        model's context, or all prompts x n choices beyond the whole cell pool (admitting that would
        preempt every other request and still not fit). Reads only constants: safe from any thread."""
        limit = self.runner.max_model_len
        longest = max(prompt_lens)
        if longest + max_tokens > limit:
            raise PromptTooLong(
                f"{longest} prompt tokens + max_tokens {max_tokens} exceed the model's context of {limit} tokens; "
                "shorten the prompt or lower max_tokens", "max_tokens" if longest < limit else "prompt")
        need = sum(prompt_lens) + len(prompt_lens) * n * max_tokens
        if need > self.cache.n_cells:
            what = f"{len(prompt_lens)} prompts" if len(prompt_lens) > 1 else "the prompt"
            raise PromptTooLong(
                f"{what} ({sum(prompt_lens)} tokens) + {len(prompt_lens) * n} choices x max_tokens {max_tokens} "
                f"need {need} cells, more than the whole cell pool ({self.cache.n_cells} cells); send fewer "
                "prompts or choices, lower max_tokens, or start the server with more cells", "prompt")

    def _check_queue(self) -> None:
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue} requests); retry shortly")

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Delete persistent sequences idle for longer than the TTL; return their ids."""
        now = time.monotonic() if now is None else now
        expired = [s.seq_id for s in self.sequences.values()
                   if s.request is None and now - s.last_used > self.config.seq_ttl_s]
        for seq_id in expired:
            self.delete(seq_id)
        return expired

    def stats(self) -> EngineStats:
        sched = self.scheduler
        idle = sum(1 for s in self.sequences.values() if s.request is None)
        used = self.cache.used_cells()
        prefix = sched.prefix.stats
        return EngineStats(self.cache.n_cells, used, self.cache.n_cells - used, self.cache.read_len,
                           len(sched.running), len(sched.waiting), idle, sched.preemptions,
                           self.generated_tokens, self.prompt_tokens, self.steps,
                           len(sched.holders) - len(sched.running) - idle, prefix.queried_tokens, prefix.hit_tokens)

    def cached_prefix_cells(self) -> int:
        """Cells owned only by cached prefixes: evicted on demand, so free in all but name (one
        reduction over the owner table: for reports, not for every tick)."""
        cached = [s.slot for s in self.scheduler.cached_prefixes()]
        if not cached:
            return 0
        r = self.cache.read_len
        live = [slot for slot in self.scheduler.holders if slot not in set(cached)]
        by_cached = self.cache.owner[cached, :r].any(0)
        by_live = self.cache.owner[live, :r].any(0) if live else torch.zeros_like(by_cached)
        return int((by_cached & ~by_live).sum())

    def free_cells(self) -> int:
        """Cells a new request can get: free ones plus those only cached prefixes hold."""
        return self.cache.free_cells() + self.cached_prefix_cells()

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (not live sequences); return the cells that became free."""
        before = self.cache.free_cells()
        for seq in self.scheduler.cached_prefixes():
            self.scheduler.release(seq)
        return self.cache.free_cells() - before


def _flatten(chunks: list[Chunk], sample_chunks: list[Chunk], prompt_rows: dict[int, int] | None = None) -> FlatStep:
    """The flat step, keeping logits only for the chunks that sample (at least one row: 0 means all),
    then, in chunk order, the first `prompt_rows[id(chunk)]` rows of chunks whose prompt logprobs are
    wanted (one arange per such chunk: a loop over chunks, not tokens)."""
    step = flatten_step({c.seq.slot: (c.token_ids, c.start) for c in chunks})
    sampling = {id(c) for c in sample_chunks}
    last = step.logits_indices
    pick = [i for i, c in enumerate(chunks) if id(c) in sampling]
    extra = [torch.arange(prompt_rows[id(c)]) + (last[i] - c.n_tokens + 1)
             for i, c in enumerate(chunks) if prompt_rows and id(c) in prompt_rows]
    step.logits_indices = torch.cat([last[pick], *extra]) if pick or extra else last[[0]]
    return step


def _end_unforked(req: Request, choices: dict[int, CompletionOutput]) -> None:
    """n > 1 ended (cancel, failed forward) before its prompt was prefilled and forked: the choices that
    were never forked end the same way as choice 0, so every one of the n choices reports a finish."""
    first = req.seqs[0]
    for i in range(1, req.children_pending + 1):
        choices[i] = CompletionOutput(i, finish_reason=first.finish_reason, error=first.error)
    req.children_pending = 0


def _eos_ids(runner: ModelRunner) -> list[int]:
    ids: set[int] = set()
    gen = getattr(runner.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(runner.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)
