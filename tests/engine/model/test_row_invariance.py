"""Row invariance (engine/model/native/rows.py): a step of up to INVARIANT_ROWS rows computes each row exactly as
a lone decode row. The oracle is the one-row decode itself: a sequence's next tokens decoded one step at a time
give logits that must be bitwise equal to the same tokens' rows in one verification-like step (a chunk beside
another sequence's decode, the sequence's cells elsewhere in the pool). This is what keeps greedy output with
speculative drafts token for token the output without them in bf16 (tests/engine/spec/test_speculative.py)."""

import pytest
import torch
from cpu_features import has_amx
from tiny_models import tiny_model

from engine.model.flat_step import flatten_step
from engine.model.kernels import build as kernels
from engine.model.runner import ModelRunner


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


def assert_drafted_rows_match_decode(make_runner, prompt, exact: bool = True) -> None:
    """A sequence's next 9 tokens decoded one step at a time (runners from `make_runner()`) give logits bitwise
    equal to their rows in one step that verifies them as drafts beside another sequence's decode row, this
    sequence's cells lying elsewhere in the pool. `prompt(n, seed)`: n token ids."""
    prefix, drafts, other = prompt(40, 1), prompt(9, 2), prompt(7, 3)
    alone = make_runner()
    alone.run({0: (prefix, 0)})
    decoded = [alone.run({0: ([t], len(prefix) + i)})[0] for i, t in enumerate(drafts)]
    together = make_runner()
    together.run({5: (other, 0)})  # another sequence takes the first cells: this one's lie elsewhere
    together.run({0: (prefix, 0)})
    step = flatten_step({0: (drafts, len(prefix)), 5: ([prompt(1, 4)[0]], len(other))})
    step.logits_indices, step.drafts = torch.arange(len(drafts)), True
    verified = together.forward(step)
    for i, row in enumerate(decoded):
        if exact:
            assert torch.equal(verified[i], row), f"drafted row {i}: max difference {(verified[i] - row).abs().max()}"
        else:  # bf16 without AMX: oneDNN past one row, rounded as bf16 rounds
            torch.testing.assert_close(verified[i].float(), row.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "gemma3"])
def test_a_chunk_of_drafted_rows_gives_the_decode_rows_logits(name, kv_cache_dtype):
    exact = has_amx()  # bitwise with AMX (amx_linear); without it only bf16-close (rows.py)
    assert kernels.load(), kernels.why_not()
    model = tiny_model(name).to(torch.bfloat16)
    assert_drafted_rows_match_decode(lambda: ModelRunner(model, n_cells=256, kv_cache_dtype=kv_cache_dtype), _prompt,
                                     exact)
