"""The vectorised sampler (its parameters, torch-free, are `engine.api.sampling_params.SamplingParams`).

`Sampler` turns a step's logits `[B, V]` into one token per row with batched tensor ops: logit bias and
penalties by scatter, then temperature, min-p, top-k and top-p by one sort and masks over the whole
matrix, then a Gumbel-max / exponential race draw whose noise comes from each row's own
`torch.Generator`. A seeded row therefore yields the same tokens whatever else shares the batch.

Processing order (the vLLM v1 order): logit_bias -> repetition penalty -> frequency/presence penalty ->
token rules (allowed_token_ids, bad_words, min_tokens: banned tokens become -inf) -> grammar mask ->
greedy argmax, or temperature -> min_p -> top_k -> top_p -> draw.

Logprobs are "raw" (vLLM v1's default `raw_logprobs`): `log_softmax` of the logits exactly as the model
produced them, before bias, penalties, temperature and truncation. They describe the model, not the
sampling transform.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.api.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one sequence: seeded from `params.seed`, or from a fresh random seed if None.

    The engine creates one per sequence when it is admitted and keeps it for the sequence's lifetime
    (including across preemption), so seeded outputs are reproducible.
    """
    g = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    g.manual_seed(seed % 2**64)
    return g


@dataclass
class SampleResult:
    """One entry per row. `logprobs[i]` / `top_logprobs[i]` are None for rows that did not ask for them;
    `top_logprobs[i]` holds `params.logprobs` (token id, logprob) pairs, most likely first."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Picks one token per logits row. Stateless: all randomness comes from the per-row generators.

    Call once per step with the rows whose logits were kept:
        sampler(logits, params, generators, output_ids, prompt_ids)
    - logits: [B, V] float tensor (not modified).
    - params: B SamplingParams.
    - generators: B generators (from `make_generator`); None is allowed for greedy rows. Noise is drawn on
      each generator's device and moved to the logits' device, so a CPU generator works with CUDA logits
      (and gives the same tokens as on CPU); a generator on the logits' device avoids the copy.
      Only non-greedy rows consume randomness, exactly V exponential draws per call.
    - output_ids: B lists of the row's previously generated token ids (presence/frequency penalties use
      these; repetition penalty uses prompt + output). Only read for rows with penalties.
    - prompt_ids: B lists of prompt token ids, or None (then repetition penalty sees only the output).
    - grammars: B `engine.sample.grammar.GrammarState` or None (structured output): a row with one may only
      pick a token its grammar allows. The mask is applied after bias and penalties, before
      temperature and truncation (vLLM's order); logprobs stay raw (the unmasked model).
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 output_ids: Sequence[Sequence[int]] | None = None,
                 prompt_ids: Sequence[Sequence[int]] | None = None,
                 grammars: Sequence[object | None] | None = None) -> SampleResult:
        B = self._check_inputs(logits, params, generators, output_ids, prompt_ids, grammars)
        want_lp = any(p.logprobs is not None for p in params)
        plain = not any(p.has_penalties or p.logit_bias or p.masks_tokens for p in params)
        constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
        if plain and not want_lp and not constrained and all(p.greedy for p in params):
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * B, [None] * B)

        x = logits.float().clone()
        if not plain:
            self._apply_bias_and_penalties(x, params, output_ids, prompt_ids)
            if any(p.masks_tokens for p in params):
                self._apply_token_rules(x, params, output_ids)
        if constrained:
            from engine.sample.grammar import apply_masks  # xgrammar is loaded only once a grammar is used

            apply_masks(x, constrained, [grammars[i] for i in constrained])
        tokens = self._choose(x, params, generators)
        lp, top = self.logprobs(logits, tokens, params) if want_lp else ([None] * B, [None] * B)
        return SampleResult(tokens.tolist(), lp, top)

    def distribution(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     output_ids: Sequence[Sequence[int]] | None = None,
                     prompt_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The probabilities `[B, V]` each row's token is drawn from (the same processing as `__call__`, no
        grammar): a greedy row's is one-hot at its argmax. Speculative sampling with a draft model compares
        these (the target's p against the draft's q)."""
        B = self._check_inputs(logits, params, None, output_ids, prompt_ids)
        x = logits.float().clone()
        if any(p.has_penalties or p.logit_bias or p.masks_tokens for p in params):
            self._apply_bias_and_penalties(x, params, output_ids, prompt_ids)
            if any(p.masks_tokens for p in params):
                self._apply_token_rules(x, params, output_ids)
        probs = torch.zeros_like(x)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=x.device)
            probs[idx, x.index_select(0, idx).argmax(dim=-1)] = 1.0
        sampled = [i for i in range(B) if not params[i].greedy]
        if sampled:
            idx = torch.tensor(sampled, device=x.device)
            probs[idx] = torch.softmax(_scaled(x, idx, [params[i] for i in sampled]), dim=-1)
        return probs

    @staticmethod
    def _check_inputs(logits, params, generators, output_ids, prompt_ids, grammars=None) -> int:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        for name, rows in (("params", params), ("generators", generators),
                           ("output_ids", output_ids), ("prompt_ids", prompt_ids), ("grammars", grammars)):
            if rows is not None and len(rows) != B:
                raise ValueError(f"{name} has {len(rows)} entries but logits has {B} rows; pass one per row")
        for i, (p, g) in enumerate(zip(params, generators or ())):  # None: no draw (`distribution`)
            if g is None and not p.greedy:
                raise ValueError(f"row {i} samples (temperature {p.temperature}) but has no generator; "
                                 "create one per sequence with make_generator(params)")
        return B

    @staticmethod
    def _apply_bias_and_penalties(x: torch.Tensor, params, output_ids, prompt_ids) -> None:
        """In place on x [B, V]: logit_bias, then repetition (HF), then frequency/presence (OpenAI)."""
        B, V = x.shape
        dev = x.device
        bias_rows = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        if bias_rows:
            r, t, b = zip(*bias_rows)
            x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                         torch.tensor(b, device=dev, dtype=x.dtype), accumulate=True)

        out = output_ids if output_ids is not None else [()] * B
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            seqs = [list(out[i]) + (list(prompt_ids[i]) if prompt_ids is not None else []) for i in rep]
            r, t = _flat_index(rep, seqs, dev)
            seen[r, t] = True
            rp = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            x.copy_(torch.where(seen, torch.where(x > 0, x / rp, x * rp), x))

        pf = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if pf:
            counts = torch.zeros(B, V, dtype=x.dtype, device=dev)
            r, t = _flat_index(pf, [out[i] for i in pf], dev)
            counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=x.dtype)[:, None]
            x.sub_(freq * counts + pres * (counts > 0).to(x.dtype))

    @staticmethod
    def _apply_token_rules(x: torch.Tensor, params, output_ids) -> None:
        """In place on x [B, V]: every token a row's rules ban becomes -inf, in one masked fill.

        allowed_token_ids: all but those. min_tokens: stop_token_ids and eos_token_ids while fewer than
        min_tokens tokens were generated. bad_words: a one-token word always; a longer word's last token
        when the output ends with the rest of the word."""
        B, V = x.shape
        dev = x.device
        out = output_ids if output_ids is not None else [()] * B
        ban = torch.zeros(B, V, dtype=torch.bool, device=dev)
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed:
            ban[allowed] = True
            r, t = _flat_index(allowed, [params[i].allowed_token_ids for i in allowed], dev)
            ban[r, t] = False
        rows, toks = [], []
        for i, p in enumerate(params):
            if p.min_tokens and len(out[i]) < p.min_tokens:
                ids = p.stop_token_ids + p.eos_token_ids
                rows += [i] * len(ids)
                toks += ids
            if p.bad_words_ids:
                k = max(len(w) for w in p.bad_words_ids) - 1
                history = list(out[i][max(len(out[i]) - k, 0):]) if k else []
                for w in p.bad_words_ids:
                    if len(w) == 1 or (len(history) >= len(w) - 1 and history[len(history) - len(w) + 1:] == w[:-1]):
                        rows.append(i)
                        toks.append(w[-1])
        if rows:
            ban[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)] = True
        x.masked_fill_(ban, float("-inf"))

    def _choose(self, x: torch.Tensor, params, generators) -> torch.Tensor:
        """Greedy rows: argmax of x. Other rows: truncate x / T, then the exponential race per row."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return x.argmax(dim=-1)
        dev = x.device
        idx = torch.tensor(sampled, device=dev)
        scaled = _scaled(x, idx, [params[i] for i in sampled])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; in log space logit - log(E).
        # The noise of row i comes only from generator i, so its token ignores the rest of the batch.
        noise = torch.stack([_exponential(x.shape[1], generators[i], x.dtype).to(dev) for i in sampled])
        noise.clamp_(min=torch.finfo(x.dtype).tiny)  # never log(0): a masked -inf logit stays -inf
        tokens = x.argmax(dim=-1)
        tokens[idx] = (scaled - noise.log()).argmax(dim=-1)
        return tokens

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
                 ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """Raw logprobs (see module docstring) of `tokens` (one per row, chosen by any rule: sampled here, or
        kept by a speculative verification) and each row's `params.logprobs` top alternatives; None for the
        rows whose params ask for none."""
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        idx = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
        k = max(params[i].logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out_lp: list[float | None] = [None] * len(params)
        out_top: list[list[tuple[int, float]] | None] = [None] * len(params)
        for j, i in enumerate(want):
            n = params[i].logprobs
            out_lp[i] = chosen[j]
            out_top[i] = list(zip(top_i[j][:n], top_v[j][:n]))
        return out_lp, out_top


def advance(generator: torch.Generator, rows: int, vocab_size: int) -> None:
    """Move `generator` past `rows` sampled rows of `vocab_size` logits, drawing exactly what the Sampler
    draws for them (speculative decoding rewinds a generator, then replays only the rows it kept)."""
    for _ in range(rows):
        _exponential(vocab_size, generator, torch.float32)


def _exponential(n: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """n Exp(1) draws from g, made on g's own device (a CPU generator also serves CUDA logits)."""
    return torch.empty(n, device=g.device, dtype=dtype).exponential_(generator=g)


def _flat_index(rows: list[int], seqs: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors for scattering each row's token ids into a [B, V] matrix."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    r = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    # One tensor per row, concatenated: no Python loop over the (possibly long) token histories.
    t = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs]).to(device)
    return r, t


def _scaled(x: torch.Tensor, idx: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """Rows `idx` of x divided by their temperature, then truncated (min_p, top_k, top_p): what is drawn from."""
    temp = torch.tensor([p.temperature for p in rows], device=x.device, dtype=x.dtype)[:, None]
    scaled = x.index_select(0, idx) / temp
    return _truncate(scaled, rows) if any(p.truncates for p in rows) else scaled


def _truncate(scaled: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p (vLLM's order) on temperature-scaled logits, by one sort.

    top_p keeps the smallest most-likely set whose probability reaches p (computed after min_p and
    top_k removed tokens); the most likely token is always kept. Removed logits become -inf.
    """
    dev, dt = scaled.device, scaled.dtype
    V = scaled.shape[1]
    srt, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=dev)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in rows], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in rows], device=dev, dtype=dt)[:, None]
    min_p = torch.tensor([p.min_p for p in rows], device=dev, dtype=dt)[:, None]

    probs = torch.softmax(srt, dim=-1)
    drop = (probs < min_p * probs[:, :1]) | (rank >= top_k)
    srt = srt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly more likely than this token
    drop = (before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, srt)


