"""Embeddings, rerank and score over a real server: every vector equals the pooled (last, mean, cls), unit-length
final hidden state of a direct transformers forward of the same model (the oracle), whichever input form
(text, texts, token ids, token-id lists) and encoding (float, base64: the openai SDK's default) carries it;
the openai SDK and LangChain's `OpenAIEmbeddings` work unchanged; the cells an embedding borrows are free
again after it, and a generation running meanwhile is unchanged; rerank/score are the vectors' cosines."""

import threading

import openai
import pytest
import torch
from http_support import Greedy, LiveServer
from transformers import AutoModel, AutoTokenizer

TEXTS = ["Romeo loves Juliet", "a plague on both your houses", "the quality of mercy is not strained"]


@pytest.fixture(scope="module")
def oracle(model_dir):
    base = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)

    def vector(item, pooling="last"):
        ids = tok.encode(item) if isinstance(item, str) else item
        with torch.no_grad():
            h = base(input_ids=torch.tensor([ids])).last_hidden_state[0]
        pooled = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
        return torch.nn.functional.normalize(pooled, dim=0)

    vector.tok = tok
    return vector


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, n_cells=512, max_num_batched_tokens=8) as server:  # inputs span several chunks
        yield server


def close(got, want) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float32), want, atol=1e-4)


def test_openai_sdk_vectors_equal_the_oracle(srv, oracle):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model="m", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, text in zip(got.data, TEXTS):
        assert close(d.embedding, oracle(text)), text
    assert got.usage.prompt_tokens == sum(len(oracle.tok.encode(t)) for t in TEXTS) == got.usage.total_tokens
    bare = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)  # without /v1 too
    assert close(bare.embeddings.create(model="m", input=TEXTS[0], encoding_format="float").data[0].embedding,
                 oracle(TEXTS[0]))


def test_every_input_form_and_the_refusals(srv, oracle):
    ids = [oracle.tok.encode(t) for t in TEXTS[:2]]
    with srv.client() as c:
        one = c.post("/v1/embeddings", json={"input": ids[0]}).json()
        assert len(one["data"]) == 1 and close(one["data"][0]["embedding"], oracle(ids[0]))
        many = c.post("/v1/embeddings", json={"input": ids}).json()
        assert [close(d["embedding"], oracle(i)) for d, i in zip(many["data"], ids)] == [True, True]
        tail = oracle.tok.encode(" houses", add_special_tokens=False)
        mixed = c.post("/v1/embeddings", json={"input": [*ids[1][:3], " houses"]}).json()["data"]  # llama.cpp's mix
        assert len(mixed) == 1 and close(mixed[0]["embedding"], oracle([*ids[1][:3], *tail]))
        parts = c.post("/v1/embeddings", json={"input": [{"content": [{"type": "text", "text": TEXTS[0]}]},
                                                          {"prompt_string": TEXTS[1]}]}).json()["data"]
        assert close(parts[0]["embedding"], oracle(TEXTS[0])) and close(parts[1]["embedding"], oracle(TEXTS[1]))
        size = len(one["data"][0]["embedding"])
        assert c.post("/v1/embeddings", json={"input": "x", "dimensions": size}).status_code == 200
        for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                            ({"input": [[]]}, "input"), ({"input": [10**6]}, "input"), ({"input": 5}, "input"),
                            ({"input": [{"content": [{"type": "image"}]}]}, "input"), ({"input": {"content": "x"}}, "input"),
                            ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
            r = c.post("/v1/embeddings", json=body)
            assert r.status_code == 400 and param in r.json()["error"]["param"], (body, r.text)


def test_langchain_openai_embeddings(srv, oracle):
    import langchain_openai  # the dev extra has it
    emb = langchain_openai.OpenAIEmbeddings(base_url=srv.url + "/v1", api_key="unused", model="m",
                                            check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS)
    assert all(close(v, oracle(t)) for v, t in zip(docs, TEXTS))
    assert close(emb.embed_query("who is Romeo?"), oracle("who is Romeo?"))


def test_embeddings_borrow_cells_and_leave_generation_unchanged(srv, model_dir):
    before = srv.cache()["cells"]["used"]
    want = Greedy(model_dir)(Greedy(model_dir).tokenizer.encode("JULIET: O Romeo"), 40).text
    got: dict = {}

    def generate():
        with srv.client() as c:
            got["text"] = c.post("/v1/completions", json={"prompt": "JULIET: O Romeo", "max_tokens": 40,
                                                          "temperature": 0}).json()["choices"][0]["text"]

    worker = threading.Thread(target=generate)
    worker.start()
    with srv.client() as c:
        for _ in range(3):
            assert c.post("/v1/embeddings", json={"input": TEXTS * 3}).status_code == 200
    worker.join(60)
    assert got["text"] == want
    with srv.client() as c:
        c.delete("/v1/cache/prefixes")
    assert srv.wait_cells_used(before, timeout=5) == before


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_flag(model_dir, oracle, pooling):
    with LiveServer(model_dir, n_cells=256, max_num_batched_tokens=4, pooling=pooling) as srv, srv.client() as c:
        got = c.post("/v1/embeddings", json={"input": TEXTS[2]}).json()["data"][0]["embedding"]
    assert close(got, oracle(TEXTS[2], pooling))


def test_rerank_and_score_are_cosines_of_the_vectors(srv, oracle):
    query, docs = TEXTS[0], [TEXTS[1], TEXTS[0], {"text": TEXTS[2]}]
    texts = [TEXTS[1], TEXTS[0], TEXTS[2]]
    want = [float(oracle(query) @ oracle(t)) for t in texts]
    with srv.client() as c:
        got = c.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()
        assert [r["index"] for r in got["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
        assert got["results"][0]["index"] == 1 and got["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-4)
        assert got["results"][0]["document"] == {"text": TEXTS[0]}
        for r in got["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        tei = c.post("/rerank", json={"query": query, "texts": texts, "return_text": True}).json()  # TEI's shape
        assert [(r["index"], r["text"]) for r in tei][:1] == [(1, TEXTS[0])] and len(tei) == 3
        assert c.post("/v1/rerank", json={"query": query, "texts": texts, "documents": texts}).status_code == 400
        bare = c.post("/rerank", json={"query": query, "documents": texts, "return_documents": False}).json()
        assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
        scored = c.post("/v1/score", json={"text_1": query, "text_2": texts}).json()["data"]
        assert [s["score"] for s in scored] == pytest.approx(want, abs=1e-4)
        assert c.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]}).status_code == 400
        assert c.post("/v1/rerank", json={"query": query, "documents": []}).status_code == 400
