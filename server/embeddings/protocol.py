"""Request schemas of `/v1/embeddings` (OpenAI's), `/v1/rerank` (Cohere's and Jina's, as llama.cpp and vLLM take
it) and `/v1/score` (vLLM's): what a client may send, checked before any work (400 naming the field)."""

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from server.schema import ParamError, StrictModel

MAX_DOCUMENTS = 1024


class EmbeddingRequest(StrictModel):
    """`input`: OpenAI's forms (a string, a list of strings, a list of token ids, a list of token-id lists) and
    llama.cpp's (a list mixing token ids and strings is one input; `{"prompt_string": text}` and
    `{"content": [{"type": "text", "text": ...}]}` entries)."""

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> list[str | list[int | str]]:
        return normalize_inputs(value)


INPUT_FORMS = ("input must be a string, a list of strings, a list of token ids, a list of token-id lists (or llama.cpp's "
               "mixed lists and {prompt_string} / {content} objects), none of them empty")


def normalize_inputs(value: Any) -> list[str | list[int | str]]:
    """Every input form as a list of inputs, each a text or a list of token ids and texts."""
    if isinstance(value, (str, dict)):
        return [_one(value)]
    if not isinstance(value, list) or not value:
        raise ValueError(INPUT_FORMS)
    if all(_is_id(v) or isinstance(v, str) for v in value) and any(_is_id(v) for v in value):
        return [list(value)]  # token ids, or llama.cpp's mix of ids and texts: one input
    return [_one(v) for v in value]


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _one(item: Any) -> str | list[int | str]:
    if isinstance(item, dict):  # llama.cpp's objects: {"prompt_string": text} or {"content": [text parts]}
        parts = item.get("content")
        if isinstance(item.get("prompt_string"), str):
            item = item["prompt_string"]
        elif isinstance(parts, list) and parts and all(isinstance(p, dict) and p.get("type") == "text"
                                                      and isinstance(p.get("text"), str) for p in parts):
            item = "".join(p["text"] for p in parts)
        else:
            raise ValueError(INPUT_FORMS)
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and all(_is_id(t) or isinstance(t, str) for t in item):
        return list(item)
    raise ValueError(INPUT_FORMS)


class RerankRequest(StrictModel):
    """Cohere's/Jina's `documents`, or Hugging Face TEI's `texts` (then the answer is TEI's bare list)."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | dict[str, Any]] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS)
    texts: list[str] | None = Field(None, min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    return_text: bool = False  # TEI's

    @field_validator("documents")
    @classmethod
    def _texts(cls, value: list) -> list[str]:
        out = []
        for doc in value:
            text = doc.get("text") if isinstance(doc, dict) else doc
            if not isinstance(text, str) or not text:
                raise ValueError("each document is a non-empty string or {\"text\": \"...\"}")
            out.append(text)
        return out

    @model_validator(mode="after")
    def _one_list(self):
        if (self.documents is None) == (self.texts is None):
            raise ParamError("documents", "give documents (Cohere, Jina) or texts (TEI), one of them")
        return self

    def docs(self) -> list[str]:
        return self.documents if self.documents is not None else self.texts


class ScoreRequest(StrictModel):
    """vLLM's `/score`: `text_1` against `text_2` (one to one, one to many, or pairwise lists)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="after")
    def _paired(self):
        self.pairs()
        return self

    def pairs(self) -> list[tuple[str, str]]:
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not left or not right or any(not t for t in left + right):
            raise ValueError("text_1 and text_2 must be non-empty")
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise ValueError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many "
                             "of each")
        return list(zip(left, right))
