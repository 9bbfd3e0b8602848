"""One `/v1/responses` turn on a persistent sequence: where it runs, what it appends, and what is kept.

`plan` decides, before anything is generated:
- no `previous_response_id`: the conversation is rendered with the chat template; stored (`store`,
  the default), it runs on a new persistent sequence, else as a plain request;
- continuing a stored response `R`: only the new turn is rendered and appended. The glue is what the
  template puts after an assistant reply and before the next generation prompt (end of turn, the new
  messages, the generation prompt), found by rendering the conversation with a marker as R's reply:
  R's real reply tokens stay as the model wrote them. If R is its sequence's tip the turn appends to
  that sequence in place; otherwise (R was already continued, or `store: false`) it forks the
  sequence at R's length (zero-copy) and appends to the fork. If the template does not render the
  conversation as R's prompt plus a reply plus the glue (new `instructions` or `tools` change what
  came first, or the template rewrites earlier turns), the whole conversation is rendered and run
  on a new sequence instead (correct, and the prefix cache still shares what it can).
`settle` keeps what ended well (a stored response at the sequence's new length) and undoes the
rest: a failed or cancelled turn leaves no sequence behind, and a tip it appended to is truncated
back, so the response it continued is the tip again.
"""

import asyncio
import contextlib
from dataclasses import dataclass

from fastapi import Request

from engine.api.errors import EngineError, EngineUnavailable, SequenceNotFound
from server.errors import APIError
from server.generation.driver import ClientGone, await_or_disconnect
from server.generation.run import GenerationRun
from server.generation.toolcalls import Prompting, prompt_args
from server.responses.store import ResponseStore, Stored, system
from server.state import ServerContext
from server.tokenization import TokenizerService

MARK = "CELLSERVE_REPLY_MARK_41c7"  # stands for an earlier reply while the glue after it is rendered


@dataclass
class Turn:
    mode: str  # tip | fork | new | plain (no sequence)
    seq_id: str | None
    append: list[int]  # token ids this turn submits
    history: int  # tokens already in the sequence before them
    cached_before: int  # of those, tokens that have cells
    prev: Stored | None
    inputs: list[dict]
    instructions: str | None
    tools: Prompting | None
    template_kwargs: dict | None = None  # the chat template's extra variables (the thinking switch)

    @property
    def input_tokens(self) -> int:
        return self.history + len(self.append)

    def cached_tokens(self, engine_cached: int) -> int:
        """Prompt tokens whose cells were reused: the sequence's own, or as far as the prefix cache reached
        past them (the engine counts only what it found beyond the history)."""
        return self.history + engine_cached if engine_cached > 0 else self.cached_before


async def render(tokens: TokenizerService, messages: list[dict], prompting: Prompting | None,
                 template_kwargs: dict | None = None) -> str:
    """The chat template's text for `messages` with the generation prompt (a 400 if the template refuses)."""
    if not tokens.has_chat_template:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a plain "
                       "prompt instead", param="input")
    messages, tools = prompt_args(prompting, messages)
    tokens.check_length([str(m.get("content") or "") for m in messages], "input")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        return await asyncio.to_thread(tokens.tok.apply_chat_template, messages, add_generation_prompt=True,
                                       tokenize=False, **extra)
    except Exception as exc:  # jinja errors: the template rejects these roles or this order
        raise APIError(400, f"the chat template rejected this conversation: {exc}", param="input") from exc


async def glue_ids(tokens: TokenizerService, prev: Stored, instructions: str | None, tools: Prompting | None,
                   inputs: list[dict], template_kwargs: dict | None = None) -> list[int] | None:
    """The tokens that continue `prev`'s sequence with `inputs` as the next turn, or None if the template
    does not render the conversation as prev's prompt + reply + glue."""
    before = prev.history()[:-1]
    prompt = await render(tokens, system(prev.instructions) + before, prev.tools, prev.template_kwargs)
    full = await render(tokens, system(instructions) + before + [{"role": "assistant", "content": MARK}] + inputs,
                        tools, template_kwargs)
    if not full.startswith(prompt + MARK) or MARK in full[len(prompt) + len(MARK):]:
        return None
    glue = full[len(prompt) + len(MARK):]
    if prev.end_token_text and glue.startswith(prev.end_token_text):
        glue = glue[len(prev.end_token_text):]  # the reply's stop token is already in the sequence
    if not glue:
        return None
    return await tokens.encode(glue, add_special_tokens=False, param="input")


async def _engine(request: Request, work):
    """Await an engine verb that makes a sequence; if the client leaves, it is undone and ClientGone raised."""
    task = asyncio.ensure_future(work)
    try:
        return await await_or_disconnect(request, task, lambda: None)
    except ClientGone:
        if task.done() and not task.cancelled() and task.exception() is None:
            with contextlib.suppress(EngineError):
                await request.app.state.ctx.engine.delete(task.result().seq_id)
        raise


async def plan(request: Request, ctx: ServerContext, store: ResponseStore, *, inputs: list[dict],
               instructions: str | None, tools: Prompting | None, prev: Stored | None, keep: bool,
               max_tokens: int | None, template_kwargs: dict | None = None) -> tuple[Turn, int]:
    """Where this turn runs and what it appends (raises ClientGone if the client left while a sequence was
    made: nothing is left behind); returns the turn and its max_tokens."""
    engine = ctx.require_engine()
    kwargs = template_kwargs or None
    glue = None if prev is None else await glue_ids(ctx.tokens, prev, instructions, tools, inputs, kwargs)
    if glue is not None:
        turn = Turn("fork", prev.seq_id, glue, prev.length, 0, prev, inputs, instructions, tools, kwargs)
        max_tokens = _fit(engine, turn, max_tokens)
        if keep and store.claim_tip(prev):
            turn.mode = "tip"
            try:
                info = await _known(store, engine.sequence_info(prev.seq_id), prev)
            except BaseException:
                store.release(prev.seq_id, tip=prev.id)
                raise
            if info.length == prev.length:
                store.hold(prev.seq_id)
                turn.cached_before = max(info.n_cached, info.n_saved)  # saved cells load when it runs
                return turn, max_tokens
            turn.mode = "fork"  # the sequence went on past it (a turn a restart cut short): not its tip after all
        info = await _known(store, _engine(request, engine.fork(prev.seq_id, prev.length)), prev)
        turn.seq_id, turn.cached_before = info.seq_id, max(info.n_cached, info.n_saved)
        store.hold(info.seq_id)
        return turn, max_tokens
    earlier = prev.history() if prev is not None else []
    messages, template_tools = prompt_args(tools, system(instructions) + earlier + inputs)
    ids = await ctx.tokens.encode_chat(messages, tools=template_tools, template_kwargs=kwargs)
    if not keep:
        turn = Turn("plain", None, ids, 0, 0, prev, inputs, instructions, tools, kwargs)
        return turn, _fit(engine, turn, max_tokens)
    # A new sequence holding the first token; the rest is this turn's prompt, so the prefix cache can
    # serve it (and the engine report what it served) as for any request.
    turn = Turn("new", None, ids[1:], 1, 0, prev, inputs, instructions, tools, kwargs)
    max_tokens = _fit(engine, turn, max_tokens)
    info = await _engine(request, engine.create_sequence(ids[:1]))
    turn.seq_id = info.seq_id
    store.hold(info.seq_id)
    return turn, max_tokens


def _fit(engine, turn: Turn, max_tokens: int | None) -> int:
    """max_tokens (up to the end of the context when not given), checked against the context and pool
    before any sequence is made (PromptTooLong: a 400 `context_length_exceeded`)."""
    if max_tokens is None:
        max_tokens = engine.max_tokens_left(turn.input_tokens)
    engine.check_fits([turn.input_tokens], max_tokens)
    return max_tokens


async def _known(store: ResponseStore, work, prev: Stored):
    """An engine call on `prev`'s sequence; if the sequence is gone, `prev` (and its siblings) are too: 404."""
    try:
        return await work
    except SequenceNotFound:
        store.forget_sequence(prev.seq_id)
        raise APIError(404, f"previous_response_id {prev.id!r}: its sequence expired (--seq-ttl) or was deleted, "
                       "so the response is no longer stored; send the whole conversation as input instead",
                       param="previous_response_id", code="previous_response_not_found") from None


async def settle(ctx: ServerContext, store: ResponseStore, turn: Turn, record: Stored | None,
                 run: GenerationRun | None = None) -> None:
    """After the turn: store `record` (the turn ended well and is to be kept), or undo what the turn did.

    A turn that submitted a run first waits for that run to end (`GenerationRun.ended`): a dropped turn's
    cancel may still be queued behind its submit, and the tip is truncated only once the engine has let
    go of the sequence (truncating a busy sequence is refused). A sequence deleted or expired meanwhile
    leaves nothing to undo; an engine that is stopping refuses the undo, and the store's restart check
    (a tip longer than its response is forked, never appended to) covers what it leaves."""
    if turn.seq_id is None:
        return
    if run is not None:
        await run.ended()
    engine = ctx.engine
    unwanted: list[str] = []
    if record is not None:
        unwanted += store.add(record, tip=True)
        store.release(turn.seq_id)
    else:
        tip = None
        if turn.mode == "tip":
            with contextlib.suppress(SequenceNotFound, EngineUnavailable):
                await engine.truncate(turn.seq_id, turn.prev.length)
                tip = turn.prev.id
        if store.release(turn.seq_id, tip=tip):
            unwanted.append(turn.seq_id)
    for seq_id in unwanted:
        with contextlib.suppress(SequenceNotFound, EngineUnavailable):
            await engine.delete(seq_id)
