"""Real clients against a live server over the bundled model (with a tool-rendering chat template):
LangChain's `ChatOpenAI` (invoke, stream, bind_tools, with_structured_output in its three methods) in every
run, instructor too (JSON_SCHEMA and TOOLS modes; the test installs it, see `instructor`); in the `clients`
mark, run only when asked for (`pip install -e '.[clients]'`, then `pytest -m clients`): litellm (one chat
call) and lm-evaluation-harness's `local-completions` (loglikelihood and generate_until from local JSONL
tasks): litellm is ~230 MB installed (boto3 among its dependencies), too heavy for every run."""

import json
import math
import subprocess
import sys

import langchain_openai  # the dev extra has it; no skip
import pydantic
import pytest
import torch
from http_support import LiveServer
from tool_support import TOOLS


@pytest.fixture(scope="module")
def srv(hermes_dir):
    with LiveServer(hermes_dir, n_cells=4096) as server:
        yield server


@pytest.fixture(scope="module")
def llm(srv):
    return langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="m", max_tokens=100,
                                       temperature=0, max_retries=0)


class Verdict(pydantic.BaseModel):
    speaker: str = pydantic.Field(max_length=12)
    guilty: bool


def test_langchain_invoke_and_stream(llm):
    out = llm.invoke("Who is Juliet?")
    assert isinstance(out.content, str) and out.content
    chunks = list(llm.stream("Who is Juliet?"))
    assert "".join(c.content for c in chunks) == out.content


def test_langchain_bind_tools(llm):
    calls = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Verona?").tool_calls
    assert calls and calls[0]["name"] == "get_weather" and set(calls[0]["args"]) == {"city", "unit"}
    forced = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False).invoke("Time?").tool_calls
    assert len(forced) == 1 and forced[0]["name"] in ("get_weather", "get_time")


def test_langchain_bind_tools_auto(llm):
    out = llm.bind_tools(TOOLS).invoke("Weather in Verona?")  # tool_choice auto: a call or an answer
    assert {c["name"] for c in out.tool_calls} <= {"get_weather", "get_time"}
    assert out.tool_calls or out.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(llm, method):
    """(method="json_mode" sends json_object: any object, whose free-form strings the toy model may never
    close; tests/server/test_real_models.py runs it on SmolLM2.)"""
    out = llm.with_structured_output(Verdict, method=method).invoke("Judge Romeo.")
    assert isinstance(out, Verdict)


# ----- instructor (installed by the test) and litellm (marked: heavy) ----------------------------------------

INSTRUCTOR = "instructor==1.17.0"


@pytest.fixture(scope="module")
def instructor(tmp_path_factory):
    """instructor 1.17 pins jiter<0.15 while the openai SDK (>= 3.6x) needs jiter >= 0.16, so pip cannot put
    both in one environment; its code runs fine on the newer jiter. The test installs it without its pins
    into a folder of its own (once per run, from PyPI, as the SmolLM2 tests pull their model), with the one
    dependency the project's environment lacks (docstring-parser); the rest (openai, pydantic, jinja2, rich,
    tenacity, typer, aiohttp) is already there."""
    import importlib

    target = tmp_path_factory.mktemp("instructor")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), INSTRUCTOR,
                    "docstring-parser>=0.16"], check=True, timeout=300)
    sys.path.insert(0, str(target))
    try:
        yield importlib.import_module("instructor")
    finally:
        sys.path.remove(str(target))


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(srv, instructor, mode):
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(model="m", response_model=Verdict, max_retries=0, max_tokens=100,
                                         temperature=0, messages=[{"role": "user", "content": "Judge Romeo."}])
    assert isinstance(out, Verdict)


@pytest.mark.clients
def test_litellm_chat(srv):
    litellm = pytest.importorskip("litellm")
    out = litellm.completion(model="openai/m", api_base=srv.url + "/v1", api_key="unused", max_tokens=8,
                             temperature=0, messages=[{"role": "user", "content": "Who is Juliet?"}])
    assert out.choices[0].message.content and out.usage.completion_tokens == 8


# ----- lm-evaluation-harness (marked: heavy) ------------------------------------------------------------------

MC_YAML = """task: cellserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_YAML = """task: cellserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_DOCS = [{"question": "ROMEO: But soft, what light", "choices": ["through yonder window", "is a fish"],
            "answer": 0},
           {"question": "JULIET: O Romeo, Romeo,", "choices": ["wherefore art thou", "blue cheese"], "answer": 0},
           {"question": "Enter", "choices": ["ROMEO", "quantum", "the"], "answer": 0}]


@pytest.mark.clients
def test_lm_eval_local_completions(srv, hermes_dir, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    gen = tmp_path / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": d["question"], "answer": d["choices"][0]}) + "\n" for d in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_YAML.format(data=data))
    (tasks / "gen.yaml").write_text(GEN_YAML.format(data=gen))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", "cellserve_mc,cellserve_gen",
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
           "--model_args", (f"model=cellserve,base_url={srv.url}/v1/completions,tokenizer={hermes_dir},"
                            "num_concurrent=2,max_retries=1,tokenized_requests=True")]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                         env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    samples = {p.name: p for p in out.rglob("samples_cellserve_mc_*.jsonl")}
    assert samples, list(out.rglob("*"))
    rows = [json.loads(line) for line in next(iter(samples.values())).read_text().splitlines()]
    # the loglikelihoods equal ones computed offline from the same model (a cacheless forward)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_dir)
    model = AutoModelForCausalLM.from_pretrained(hermes_dir, dtype=torch.float32).eval()
    for row in rows:  # lm-eval's own split: whole = encode(context + continuation), no BOS
        for (ll, _greedy), args in zip([r[0] for r in row["resps"]], row["arguments"].values()):
            context, cont = args["arg_0"], args["arg_1"]
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + cont, add_special_tokens=False)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            want = sum(lp[p - 1, whole[p]].item() for p in range(len(ctx), len(whole)))
            assert math.isclose(float(ll), want, abs_tol=1e-3), (args, ll, want)
    assert len(rows) == len(MC_DOCS)
    gen_rows = next(out.rglob("samples_cellserve_gen_*.jsonl")).read_text().splitlines()
    assert len(gen_rows) == len(MC_DOCS)  # every generate_until request answered
    print(run.stdout[-1500:])
