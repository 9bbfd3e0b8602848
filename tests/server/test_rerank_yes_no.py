"""`--rerank-mode yes-no` over a real server and the bundled model: a pair's relevance is softmax over the
logits of "yes" and "no" (the bundled vocabulary has them as "Yes"/"No") at the last token of Qwen3-Reranker's
judging prompt rendered by the model's chat template, compared against a direct transformers forward of that
prompt (written out here, not taken from the server); /v1/score scores the same way; the embedding route and
the cosine mode stay as they were."""

import pytest
import torch
from http_support import LiveServer
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.loader.default import DEFAULT_MODEL_DIR

QUERY = "who loves Juliet?"
DOCS = ["Romeo loves Juliet", "a plague on both your houses", "the quality of mercy is not strained"]
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
         'Note that the answer can only be "yes" or "no".')
TASK = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def want():
    """P(yes) of (query, document) from a direct forward of the bundled model."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    assert tok.encode("yes", add_special_tokens=False) != [yes] and len(tok.encode("Yes", add_special_tokens=False)) == 1

    def p_yes(query: str, doc: str) -> float:
        turns = [{"role": "system", "content": JUDGE},
                 {"role": "user", "content": f"<Instruct>: {TASK}\n<Query>: {query}\n<Document>: {doc}"}]
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[yes, no]], 0)[0])

    return p_yes


@pytest.fixture(scope="module")
def srv():
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=2048, max_num_batched_tokens=32, rerank_mode="yes-no") as server:
        yield server


def test_rerank_scores_are_the_yes_no_softmax_of_a_direct_forward(srv, want):
    expected = [want(QUERY, d) for d in DOCS]
    assert len({round(p, 3) for p in expected}) == 3  # the documents score apart: the order below means something
    with srv.client() as c:
        got = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert [r["index"] for r in got["results"]] == sorted(range(3), key=lambda i: -expected[i])
    for r in got["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert 0.0 <= r["relevance_score"] <= 1.0
    assert got["usage"]["prompt_tokens"] > 3 * len(JUDGE) // 8  # each pair's whole judging prompt was read


def test_score_pairs_and_embeddings_unchanged(srv, want):
    pairs = [("who is mad?", "Ophelia"), (QUERY, DOCS[0])]
    with srv.client() as c:
        scored = c.post("/v1/score", json={"text_1": [q for q, _ in pairs], "text_2": [d for _, d in pairs]}).json()
        assert [s["score"] for s in scored["data"]] == pytest.approx([want(q, d) for q, d in pairs], abs=1e-4)
        vec = c.post("/v1/embeddings", json={"input": DOCS[0]}).json()["data"][0]["embedding"]
        assert sum(x * x for x in vec) == pytest.approx(1.0, abs=1e-4)  # still a unit vector, not a score
        assert c.post("/v1/rerank", json={"query": QUERY, "documents": []}).status_code == 400


def test_a_vocabulary_without_yes_and_no_is_refused(model_dir):
    """The tiny test model's vocabulary has no single yes/no tokens: a clear 400, nothing runs."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert any(len(tok.encode(w, add_special_tokens=False)) != 1 for w in ("yes", "no", "Yes", "No"))
    with LiveServer(model_dir, n_cells=256, rerank_mode="yes-no") as server, server.client() as c:
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 400 and "--rerank-mode cosine" in r.json()["error"]["message"]
        assert c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS[:1]}).status_code == 400
