"""Reasoning: a model's `<think>…</think>` split out of its answer (into `reasoning_content`, and vLLM's
newer `reasoning`), whole or streamed, and the request fields that switch thinking on or off through
the chat template (`chat_template_kwargs`, `reasoning_effort`, `thinking`).

Guarantees: the split is on only for a template that speaks `<think>`; a reply whose prompt already
opened `<think>` (DeepSeek-R1 style) starts as reasoning; tags never reach either text; streamed and
whole splits agree in any split of the text (a tag cut between deltas is held back until it is
complete or cannot be one); an unclosed `<think>` leaves everything after it as reasoning."""

THINK, END_THINK = "<think>", "</think>"


def speaks_think(chat_template) -> bool:
    from server.generation.tool_formats import template_text

    return END_THINK in template_text(chat_template) or THINK in template_text(chat_template)


def opens_thinking(prompt_tail: str) -> bool:
    """The rendered prompt ends inside an open `<think>` (the template started the reasoning)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(THINK)


def template_kwargs(chat_template, kwargs: dict | None, reasoning_effort: str | None,
                    thinking: dict | None) -> dict:
    """The extra `apply_chat_template` arguments: `chat_template_kwargs` as given, plus `reasoning_effort`
    where the template reads it, or mapped onto its `enable_thinking` switch ("none" turns it off);
    Anthropic-style `thinking: {"type": "enabled"|"disabled"}` onto the same switch. Without a switch
    they change nothing (accepted, as docs/api.md says)."""
    from server.generation.tool_formats import template_text

    text = template_text(chat_template)
    out = dict(kwargs or {})
    if reasoning_effort is not None:
        if "reasoning_effort" in text:
            out.setdefault("reasoning_effort", reasoning_effort)
        elif "enable_thinking" in text:
            out.setdefault("enable_thinking", reasoning_effort != "none")
    if thinking is not None and "enable_thinking" in text:
        out.setdefault("enable_thinking", thinking.get("type") != "disabled")
    return out


class ReasoningSplitter:
    """`feed(text)` -> (reasoning delta, content delta); `close()` flushes what was held back."""

    def __init__(self, in_reasoning: bool = False):
        self.in_reasoning = in_reasoning
        self.done = False  # one reasoning block per reply: after `</think>` everything is content
        self.pending = ""
        self.strip_next = False  # the blank after `</think>` is not content
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        r, c = "", ""
        while self.pending:
            tag = END_THINK if self.in_reasoning else (None if self.done else THINK)
            if tag is None:
                c += self.pending
                self.pending = ""
                break
            i = self.pending.find(tag)
            if i >= 0:
                before, self.pending = self.pending[:i], self.pending[i + len(tag):]
                if self.in_reasoning:
                    r += before
                    self.in_reasoning, self.done, self.strip_next = False, True, True
                else:
                    c += before
                    self.in_reasoning = True
                continue
            keep = next((n for n in range(min(len(self.pending), len(tag) - 1), 0, -1)
                         if tag.startswith(self.pending[-n:])), 0)
            out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            if self.in_reasoning:
                r += out
            else:
                c += out
            break
        return self._out(r, c)

    def close(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return self._out(rest, "") if self.in_reasoning else self._out("", rest)

    def _out(self, r: str, c: str) -> tuple[str, str]:
        if self.strip_next and c:
            c = c.lstrip()
            self.strip_next = not c
        if not self.reasoning:
            r = r.lstrip()
        self.reasoning += r
        self.content += c
        return r, c

    def split(self, text: str) -> tuple[str | None, str]:
        """Whole text -> (reasoning, or None when there was none; content)."""
        self.feed(text)
        self.close()
        return (self.reasoning or None), self.content
