"""`from engine import LLM, SamplingParams, AsyncEngine, EngineArgs` (vLLM's `from vllm import LLM,
SamplingParams`): the names are the engine's own classes, they generate what transformers generates, and
importing the engine package or its torch-free contract (engine.api) does not load torch."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import engine
from engine.api.args import EngineArgs as ArgsClass
from engine.api.sampling_params import SamplingParams as ParamsClass
from engine.core.async_engine import AsyncEngine as AsyncClass
from engine.core.llm import LLM as LLMClass


def test_the_package_exports_the_engine_classes():
    from engine import LLM, AsyncEngine, EngineArgs, SamplingParams

    assert (LLM, SamplingParams, AsyncEngine, EngineArgs) == (LLMClass, ParamsClass, AsyncClass, ArgsClass)
    assert set(engine.__all__) <= set(dir(engine))
    with pytest.raises(AttributeError, match="exports LLM"):
        engine.Engine  # noqa: B018 -- only the four names are the package's


def test_importing_the_contract_leaves_torch_out():
    code = ("import sys, engine, engine.api.client, engine.api.sampling_params, engine.api.args\n"
            "print(sorted(m for m in ('torch', 'transformers', 'engine.core.llm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_llm_from_the_package_generates_what_transformers_does(model_dir):
    from engine import LLM, SamplingParams

    prompt = [5, 17, 42, 8, 99, 3]
    got = LLM(model_dir, dtype="float32", n_cells=256).generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                                                          ignore_eos=True),
                                                                 use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert got[0].outputs[0].token_ids == want.tolist()
