"""Rerank and score by a causal model's "yes"/"no" logits (`--rerank-mode yes-no`), as vLLM and llama.cpp score
Qwen3-Reranker-style models.

Each (query, document) pair becomes Qwen3-Reranker's judging prompt (its system line and its `<Instruct>`,
`<Query>`, `<Document>` user turn) rendered by the model's own chat template with the generation prompt (and
`enable_thinking` off: Qwen3's template then ends in the empty think block Qwen3-Reranker's prompt ends in).
The engine gives the logits of "yes" and "no" at the prompt's last token (an embedding request with score
tokens: engine/core/embedding.py; "Yes"/"No" where the vocabulary has no single "yes"/"no"), and the relevance is the softmax over the two, P(yes) in [0, 1]: vLLM's
`classifier_from_token: ["no", "yes"]` score and llama.cpp's rerank of such a model. The pairs of one request
share their system line and query, so with prefix caching on the documents' prompts reuse those cells.
"""

import math

from fastapi import Request

from server.errors import APIError
from server.generation.driver import await_or_disconnect
from server.state import ServerContext

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"  # Qwen3-Reranker's default
WORDS = (("yes", "no"), ("Yes", "No"))  # the first pair the vocabulary has as single tokens is scored


def pair_messages(query: str, document: str, instruction: str = INSTRUCTION) -> list[dict]:
    """The chat turns one pair is judged in (Qwen3-Reranker's)."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"}]


def yes_no_ids(tokenizer) -> list[int]:
    """The ids of "yes" and "no" (or, where the vocabulary has no single token for one of them, of "Yes" and
    "No"); 400 if it has neither pair as single tokens."""
    for pair in WORDS:
        ids = [tokenizer.encode(word, add_special_tokens=False) for word in pair]
        if all(len(i) == 1 for i in ids):
            return [i[0] for i in ids]
    raise APIError(400, "this model's tokenizer has no single token for 'yes' and 'no' (nor 'Yes' and 'No'), so "
                   "it cannot score yes/no; serve it with --rerank-mode cosine", param="model")


async def yes_no_scores(request: Request, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """P(yes) of each (query, document) pair, and the tokens their prompts took."""
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(len(pairs), 1)
    words = yes_no_ids(ctx.tokens.tok)
    prompts = [await ctx.tokens.encode_chat(pair_messages(q, d), template_kwargs={"enable_thinking": False})
               for q, d in pairs]
    logits = await await_or_disconnect(request, engine.embed(prompts, "last", words), lambda: None)  # ClientGone
    return [_p_yes(yes, no) for yes, no in logits], sum(len(p) for p in prompts)


def _p_yes(yes: float, no: float) -> float:
    """softmax([yes, no])[0], computed without overflow."""
    return 1.0 / (1.0 + math.exp(no - yes)) if no - yes < 700 else 0.0
