"""`POST /v1/embeddings` (OpenAI), `POST /v1/rerank` (Cohere/Jina, as llama.cpp and vLLM), `POST /v1/score` (vLLM).

Vectors are the model's final hidden states pooled per input (`--pooling`: last by default, mean, cls) and
unit length, computed by the engine on its own cells (engine/core/embedding.py). Rerank and score use the
same vectors by default: a document's relevance is the cosine similarity of its vector and the query's, in
[-1, 1]; with `--rerank-mode yes-no` it is a causal reranker's P(yes) from its "yes"/"no" logits after a
judging prompt (server/embeddings/yes_no.py, Qwen3-Reranker's way). `dimensions` is refused unless it is the vectors' own size (no model here was trained to truncate).
"""

import base64
import struct

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api.ids import new_id
from server.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from server.embeddings.yes_no import yes_no_scores
from server.errors import APIError
from server.generation.driver import ClientGone, await_or_disconnect
from server.state import ServerContext

router = APIRouter()
DEFAULT_POOLING = "last"


async def _vectors(request: Request, texts: list[str | list[int | str]], param: str) -> tuple[list[list[float]], int]:
    """The unit vectors of `texts` (texts or token ids) and how many tokens they took."""
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(len(texts), 1)
    vocab = len(ctx.tokens.tok)
    prompts = []
    for item in texts:
        if isinstance(item, str):
            prompts.append(await ctx.tokens.encode(item, param=param))
            continue
        ids: list[int] = []
        for part in item:  # token ids, texts among them tokenized without special tokens
            ids += await ctx.tokens.encode(part, add_special_tokens=False, param=param) if isinstance(part, str) else [part]
        if any(t >= vocab for t in ids):
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary (size {vocab})", param=param)
        prompts.append(ids)
    pooling = getattr(request.app.state, "pooling", None) or DEFAULT_POOLING
    vectors = await await_or_disconnect(request, engine.embed(prompts, pooling), lambda: None)  # ClientGone
    return vectors, sum(len(p) for p in prompts)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def _unless_gone(answer):
    """The route's answer, or 499 when the client left before its vectors were made."""
    try:
        return await answer
    except ClientGone:
        return Response(status_code=499)


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> dict | Response:
    return await _unless_gone(_embeddings(body, request))


async def _embeddings(body: EmbeddingRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    vectors, tokens = await _vectors(request, body.input, "input")
    size = len(vectors[0])
    if body.dimensions is not None and body.dimensions != size:
        raise APIError(400, f"dimensions={body.dimensions} is not supported: this model's vectors have {size} "
                       "dimensions and it was not trained to shorten them; leave dimensions out", param="dimensions")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _yes_no(request: Request) -> bool:
    return getattr(request.app.state, "rerank_mode", None) == "yes-no"


def _cosine(a: list[float], b: list[float]) -> float:
    return float(sum(x * y for x, y in zip(a, b)))  # both are unit length


@router.post("/v1/rerank", response_model=None)
async def rerank(body: RerankRequest, request: Request) -> dict | list | Response:
    return await _unless_gone(_rerank(body, request))


async def _rerank(body: RerankRequest, request: Request) -> dict | list:
    ctx = ServerContext.of(request)
    docs = body.docs()
    if _yes_no(request):
        scores, tokens = await yes_no_scores(request, [(body.query, d) for d in docs])
    else:
        vectors, tokens = await _vectors(request, [body.query, *docs], "documents")
        scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
    if body.texts is not None:  # TEI's answer: a bare list
        return [{"index": i, "score": scores[i], **({"text": docs[i]} if body.return_text else {})} for i in order]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order]
    return {"id": new_id("rerank"), "model": ctx.model_name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/score", response_model=None)
async def score(body: ScoreRequest, request: Request) -> dict | Response:
    return await _unless_gone(_score(body, request))


async def _score(body: ScoreRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    pairs = body.pairs()
    if _yes_no(request):  # text_1 is the query, text_2 the document
        scores, tokens = await yes_no_scores(request, pairs)
    else:
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors, tokens = await _vectors(request, texts, "text_1")
        by_text = dict(zip(texts, vectors))
        scores = [_cosine(by_text[a], by_text[b]) for a, b in pairs]
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": new_id("score"), "object": "list", "model": ctx.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
