"""The quantized linear's kernels side by side per row count: where each path wins (issue 26).

    python -m engine.bench.quant_kernels [--kinds q4_1,q8_0,q4_k] [--shapes 1536x576,576x1536,2048x2048,2048x8192]
                                         [--rows 1,2,3,4,8,16,32,64,128,512] [--threads 1] [--repeats 5]
                                         [--paths rows,gemm,fp32,bf16,bf16 dense]

For a random weight of each kind and shape (N x K) and each row count: the time of one call of each
path of `QuantLinear` (engine/model/native/quant.py): `rows` (quant_linear, the row kernel), `gemm`
(quant_gemm, the blocked integer GEMM), `tiles` (quant_tiles over the weight in 16-row tiles: q8_0 / q4_0 /
q4_1 with K % 64 == 0), `fp32` (fp32 tiles + torch.mm, the path before the GEMM) and
`bf16` (bf16 tiles + torch's bf16 matmul, where the CPU has AVX512-BF16), and `bf16 dense` (F.linear
on an already-bf16 weight, what the bf16 folder's model pays, for reference). Paths alternate, best of
`--repeats` each; the fastest quantized path per row is marked (`--paths`: only those). This is what
`BF16_ROWS` was set from, and what measured the row kernel against the GEMM up to `INVARIANT_ROWS` rows
(engine/model/native/rows.py: the row kernel takes them, for row invariance).
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from engine.bench.machine import machine
from engine.loader.gguf_tensors import BLOCK_BYTES, BLOCK_WEIGHTS, KINDS, QuantWeight, pack_blocks
from engine.model.kernels import build as kernels
from engine.model.native.quant import QuantLinear

FP16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_weight(kind: str, n: int, k: int, seed: int = 0):
    """A [n, k] QuantWeight of random blocks: random bytes, the fp16 scales set to 0.01 (speed only)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind]), dtype=np.uint8)
    for off in FP16_FIELDS[kind]:
        blocks[..., off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    ggml_type = next(t for t, name in KINDS.items() if name == kind)
    return pack_blocks(blocks.reshape(n, -1), ggml_type, n, k)


def _best(f, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x)
        best = min(best, time.perf_counter() - t)
    return best


def paths(lin: QuantLinear, w: QuantWeight, w_bf16: torch.Tensor) -> dict:
    """Each path of `lin` (made from `w`, the row layout) as a function of x."""
    tensors, kind = w.tensors(), lin.kind
    out = {"rows": lambda x: torch.ops.cellserve.quant_linear(x, tensors, kind, None, None, "none"),
           "gemm": lambda x: torch.ops.cellserve.quant_gemm(x, tensors, kind, None, None, "none")}
    if lin.tiled:
        t = lin.weight
        out["tiles"] = lambda x: torch.ops.cellserve.quant_tiles(x, t.tensors(), kind, t.n, t.parts, None, None, "none")
    out["fp32"] = lambda x: lin._dense(x, bf16=False)
    if torch.ops.cellserve.quant_bf16_fast():
        out["bf16"] = lambda x: lin._dense(x, bf16=True)
    out["bf16 dense"] = lambda x: F.linear(x.bfloat16(), w_bf16)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.quant_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="q4_1,q8_0,q4_k")
    p.add_argument("--shapes", default="1536x576,576x1536,2048x2048,2048x8192")
    p.add_argument("--rows", default="1,2,3,4,8,16,32,64,128,512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--paths", default=None, help="comma-separated subset of the paths (default: all)")
    args = p.parse_args(argv)
    assert kernels.load(), kernels.why_not()
    torch.set_num_threads(args.threads)
    print("machine:", machine(), "| load average", " ".join(f"{v:.2f}" for v in __import__("os").getloadavg()))
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            if k % BLOCK_WEIGHTS[kind]:
                print(f"\n{kind} {n}x{k}: skipped, K is not whole {BLOCK_WEIGHTS[kind]}-weight blocks")
                continue
            w = random_weight(kind, n, k)
            lin = QuantLinear(w)
            lin.small = True
            fns = paths(lin, w, torch.randn(n, k).bfloat16())
            if args.paths:
                fns = {name: f for name, f in fns.items() if name in args.paths.split(",")}
            print(f"\n{kind} {n}x{k} (ms a call; * = fastest quantized path)")
            print(f"{'rows':>5} " + " ".join(f"{name:>11}" for name in fns))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                times = {name: float("inf") for name in fns}
                for _ in range(2):  # alternating rounds
                    for name, f in fns.items():
                        times[name] = min(times[name], _best(f, x, args.repeats))
                fastest = min((t, name) for name, t in times.items() if name != "bf16 dense")[1]
                print(f"{rows:5d} " + " ".join(f"{times[name] * 1e3:10.3f}{'*' if name == fastest else ' '}"
                                               for name in fns), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
