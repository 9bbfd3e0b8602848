"""One reply's text split as `/v1/responses` and `/v1/messages` show it: first the `<think>` part
(`server.generation.reasoning`, when the template speaks `<think>`), then the answer into text and tool
calls (`server.generation.toolcalls`).

Guarantees: the whole split (`Reply.split`) and the streamed one (`Reply.stream().feed`) agree for any
cut of the text into deltas; tags never reach either part; tool calls are parsed from the answer only;
`reasoning_tokens` counts the tokens generated while the reply was inside `<think>` (the closing tag's
token included), which is what `output_tokens_details.reasoning_tokens` reports.
"""

from dataclasses import dataclass

from server.generation.reasoning import ReasoningSplitter, opens_thinking, speaks_think
from server.generation.toolcalls import ToolPlan, ToolStream, chat_template_of
from server.state import ServerContext


@dataclass
class Reply:
    tools: ToolPlan
    reasoning: bool = False  # the template speaks <think>: split it out
    starts: bool = False  # the prompt already opened <think>: the reply starts as reasoning

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.starts) if self.reasoning else None

    def split(self, text: str) -> tuple[str | None, str, list[dict]]:
        """The whole text -> (reasoning, None when there was none; content; calls)."""
        splitter = self.splitter()
        reasoning, answer = splitter.split(text) if splitter is not None else (None, text)
        content, calls = self.tools.parse(answer)
        return reasoning, content, calls

    def stream(self) -> "ReplyStream":
        return ReplyStream(self.tools.stream(), self.splitter())

    def reasoning_tokens(self, pieces: list[tuple[str, int]]) -> int:
        """The reasoning tokens of a whole reply, from its outputs as they came ((text, tokens) each)."""
        splitter = self.splitter()
        if splitter is None:
            return 0
        n = 0
        for text, tokens in pieces:
            n += tokens if splitter.in_reasoning else 0
            splitter.feed(text)
        return n


async def reply_of(ctx: ServerContext, tools: ToolPlan, prompt_tail: list[int]) -> Reply:
    """How a reply to a prompt ending in `prompt_tail` is split (the tail says whether `<think>` is open)."""
    if not speaks_think(chat_template_of(ctx.tokens)):
        return Reply(tools)
    return Reply(tools, True, opens_thinking(await ctx.tokens.decode(prompt_tail[-16:])))


class ReplyStream:
    """`feed(text, n_tokens, final)` -> events: `("reasoning", str)`, then `ToolStream`'s (`text`, `begin`,
    `arguments`, `end`)."""

    def __init__(self, tools: ToolStream, splitter: ReasoningSplitter | None):
        self.tools, self.splitter = tools, splitter
        self.reasoning_tokens = 0

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls

    @property
    def called(self) -> bool:
        return self.tools.called

    def feed(self, text: str, n_tokens: int, final: bool) -> list[tuple]:
        if self.splitter is None:
            return self.tools.feed(text, final)
        if self.splitter.in_reasoning:
            self.reasoning_tokens += n_tokens
        reasoning, answer = self.splitter.feed(text)
        if final:
            more_reasoning, more_answer = self.splitter.close()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        events: list[tuple] = [("reasoning", reasoning)] if reasoning else []
        return events + self.tools.feed(answer, final)
