"""`--dtype auto` for a float model: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere
(engine/api/cpu.py), and what a float folder loads as; auto = bf16 against the float32 oracle within the
stated bf16 tolerance."""

import torch
from tiny_models import full_logits
from transformers import AutoModelForCausalLM

from engine.api.cpu import auto_float_dtype, cpu_flags
from engine.model.runner import ModelRunner

# bf16 keeps 8 bits of mantissa: every weight and activation rounded to bf16 moves a logit by ~2^-8 of the
# values summed into it, over 2 layers and the head; on the tiny model (last-row logits within +-0.35)
# measured 1.3e-3 to 1.8e-3 of max abs error over 5 random 57-token prompts. 0.01 is ~5x that; the fp32
# path agrees to 1e-4.
BF16_LOGIT_ATOL = 0.01

SAPPHIRE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_auto_is_bf16_only_with_native_bf16_matmuls():
    assert cpu_flags(SAPPHIRE) >= {"avx512_bf16", "amx_bf16"}
    assert auto_float_dtype(cpu_flags(SAPPHIRE)) == "bfloat16"
    assert auto_float_dtype(frozenset({"avx512f", "amx_bf16"})) == "bfloat16"  # AMX alone (oneDNN's tiles)
    assert auto_float_dtype(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert auto_float_dtype(cpu_flags(ZEN3)) == "float32"
    assert auto_float_dtype(cpu_flags("")) == "float32"  # no cpuinfo (macOS, Windows): float32


def test_auto_loads_a_float_folder_in_this_cpus_dtype_against_the_fp32_oracle(model_dir):
    """The tiny float32 folder under `dtype="auto"` loads in `auto_float_dtype()` (bf16 on this machine kind),
    and its logits are the float32 oracle's within the bf16 tolerance; `dtype="float32"` stays exact."""
    oracle = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    ids = list(range(3, 60))
    want = full_logits(oracle, ids)[-1]
    auto = ModelRunner.from_pretrained(model_dir, n_cells=128)
    assert auto.dtype == getattr(torch, auto_float_dtype())
    torch.testing.assert_close(auto.run({0: (ids, 0)})[0], want, atol=BF16_LOGIT_ATOL, rtol=0)
    fp32 = ModelRunner.from_pretrained(model_dir, dtype="float32", n_cells=128)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.run({0: (ids, 0)})[0], want, atol=1e-4, rtol=0)
