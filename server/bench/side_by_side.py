"""cellserve against llama.cpp's `llama-server` on the same weights, the same load, in one run.

Two commands (see docs/performance.md, "Against llama.cpp's llama-server"):

    python -m server.bench.side_by_side bpe-copy SRC_DIR DST_DIR
        A copy of a model folder (same config and weights) with an ASCII-only byte-level BPE
        tokenizer of the same vocabulary size, so that llama.cpp's converter accepts it (the
        benchmarks' 56M model ships a WordLevel tokenizer, which GGUF cannot hold). Every word of
        the load generator's prompts is one token, with or without its leading space, and every
        token decodes to ASCII, so random weights never stream invalid UTF-8 (no logit_bias needed).
        Serve the copy with both servers so both see the same token counts. The source's chat
        template is kept (llama-server uses it with `--jinja`).

    python -m server.bench.side_by_side run --gguf M.gguf --model DIR --dtype bfloat16 --out DIR
        Alternates the two servers (llama-server, cellserve, llama-server, ... `--rounds` times
        each), each started fresh, warmed up, then measured with `cellserve bench serve` at every
        `--concurrency` level; records each server's peak RSS (VmHWM of its process tree) and the
        load average, and prints one table with cellserve / llama-server ratios per round.
        `--lora A.gguf --lora B.gguf ...`: both servers load the adapters and request i names adapter
        i % N (llama.cpp's `lora: [{id, scale}]`, which cellserve reads too).

Both servers bind 127.0.0.1 only. Only the processes this script starts are stopped (by pid).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from server.bench.workloads import WORDS

ANCHOR = Path(os.environ.get("ANCHOR", Path.home() / ".cache" / "cellserve-anchor"))


# ---------------------------------------------------------------- the tokenizer copy


def bpe_tokenizer(vocab_size: int, words: tuple[str, ...] = WORDS):
    """An ASCII byte-level BPE (GPT-2 split regex) of exactly `vocab_size` ids: ids 0-2 are
    '<unk>', '<s>', '</s>' (plain tokens, so both servers stream them as text), then the
    printable-ASCII alphabet, the merges that make every word (with and without a leading space)
    one token, then filler tokens ('Ġq<n>', reachable by no merge) up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte-level characters
    ascii_chars = sorted({c for c in byte_char if len(c.encode("utf-8")) == 1 or c in "ĠĊ"})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, min_frequency=1,
                                  initial_alphabet=ascii_chars)
    corpus = [" ".join(words), *words]
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    trained = spec["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    n = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"Ġq{n}", len(vocab))
        n += 1
    if len(vocab) != vocab_size:
        raise ValueError(f"vocabulary of {len(vocab)} tokens, wanted {vocab_size}")
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def chat_template(folder: Path) -> str | None:
    """The folder's chat template: transformers 5 saves it as chat_template.jinja, older ones inside
    tokenizer_config.json."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    return json.loads(config.read_text()).get("chat_template") if config.exists() else None


def bpe_copy(src: Path, dst: Path) -> Path:
    """Copy config and weights of `src` into `dst` with `bpe_tokenizer` of the config's vocab size."""
    config = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer"):
            shutil.copy2(f, dst / f.name)
    tok = bpe_tokenizer(int(config["vocab_size"]))
    tok.save(str(dst / "tokenizer.json"))
    template = chat_template(src)
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": int(config.get("max_position_embeddings", 4096)),
        **({"chat_template": template} if template else {}),  # the GGUF carries it for llama-server --jinja
    }, indent=1))
    for w in WORDS[:5]:
        assert len(tok.encode(w).ids) == 1 and len(tok.encode(" " + w).ids) == 1, w
    return dst


# ---------------------------------------------------------------- the A/B run


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def _tree_hwm_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of `pid` plus its descendants, MB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            pass
    return total


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server started with `start_new_session=True` (its whole process group), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def server_cmd(kind: str, args: argparse.Namespace, port: int) -> list[str]:
    """Both servers with the same KV budget (`--n-ctx` tokens), threads and batch size."""
    if kind == "llama-server":
        # ggml's repacked (AMX) path can die with SIGILL on VMs that advertise AMX: --no-repack there
        repack = ["--no-repack"] if "amx_int8" in Path("/proc/cpuinfo").read_text() else []
        return [str(ANCHOR / "bin" / "llama-server"), "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(args.parallel), "-c", str(args.n_ctx), "-t", str(args.threads), "-b", "2048",
                "-ub", "512", *repack, *(["--lora", ",".join(args.lora)] if args.lora else []),
                *args.llama_args.split()]
    return [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--dtype", args.dtype,
            "--threads", str(args.threads), "--host", "127.0.0.1", "--port", str(port),
            "--max-num-batched-tokens", "2048", "--n-cells", str(args.n_ctx), "--log-level", "warning",
            *[f for k, path in enumerate(args.lora) for f in ("--lora", f"a{k}={path}")], *args.cellserve_args.split()]


def bench_cmd(url: str, c: int, n: int, args: argparse.Namespace, out: Path, output_len: int) -> list[str]:
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--url", url, "--concurrency", str(c),
           "--num-requests", str(n), "--duration", str(args.duration), "--input-len", str(args.input_len),
           "--output-len", str(output_len), "--seed", "0", "--no-progress", "--timeout", "300", "--out", str(out)]
    cmd += [] if args.stop_at_eos else ["--ignore-eos"]
    cmd += ["--lora-ids", str(len(args.lora))] if args.lora else []
    return cmd + (["--extra-body", args.extra_body] if args.extra_body else []) + args.bench_args.split()


def _free_port(preferred: int) -> int:
    """`preferred` when nothing listens there, else one the OS picks: a server already on the port would
    answer /health in place of the one started here, and the run would measure it."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port on 127.0.0.1")


def one_server(kind: str, args: argparse.Namespace, work: Path, tag: str) -> dict:
    port = _free_port(args.port + (0 if kind == "llama-server" else 1))
    url = f"http://127.0.0.1:{port}"
    log = work / f"{tag}.server.log"
    with log.open("w") as f:
        proc = subprocess.Popen(server_cmd(kind, args, port), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    row: dict = {"server": kind, "tag": tag, "levels": {}}
    try:
        deadline = time.monotonic() + 300
        while _get(f"{url}/health") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} did not come up; see {log}")
            time.sleep(0.5)
        warm = work / f"{tag}.warmup.json"  # not recorded: first-call costs of every batch size
        subprocess.run(bench_cmd(url, 8, 16, args, warm, 16), stdout=subprocess.DEVNULL, check=True)
        for c in args.levels:
            out = work / f"{tag}.c{c}.json"
            load = os.getloadavg()[0]
            subprocess.run(bench_cmd(url, c, max(args.min_requests, 2 * c), args, out, args.output_len),
                           stdout=(work / f"{tag}.c{c}.log").open("w"), check=True)
            s = json.loads(out.read_text())["levels"][0]["summary"]
            row["levels"][c] = {
                "tok_s": s["output_throughput"], "ok": s["completed"], "failed": s["failed"],
                "prompt_tokens": s["total_prompt_tokens"], "output_tokens": s["total_output_tokens"],
                "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"],
                "itl_p50": s["itl"]["p50"], "itl_p99": s["itl"]["p99"], "load1": load}
            print(f"{tag} c={c}: {row['levels'][c]}", flush=True)
        row["rss_mb"] = _tree_hwm_mb(proc.pid)
    finally:
        stop_server(proc)
    return row


def table(rows: list[dict], levels: list[int]) -> str:
    """Markdown: per round and level, both servers' figures and cellserve / llama-server."""
    head = ("| round | clients | llama-server tok/s | cellserve tok/s | ratio | TTFT p50/p99 ms llama | "
            "cellserve | gap p50/p99 ms llama | cellserve | load1 |\n|" + "---|" * 10)
    lines = [head]
    by_round: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["server"]] = r
    for k, pair in sorted(by_round.items()):
        ll, cs = pair.get("llama-server"), pair.get("cellserve")
        if not (ll and cs):
            continue
        for c in levels:
            a, b = ll["levels"].get(c), cs["levels"].get(c)
            if not (a and b):
                continue
            lines.append(
                f"| {k} | {c} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {b['tok_s'] / a['tok_s']:.2f} | "
                f"{a['ttft_p50']:.0f} / {a['ttft_p99']:.0f} | {b['ttft_p50']:.0f} / {b['ttft_p99']:.0f} | "
                f"{a['itl_p50']:.1f} / {a['itl_p99']:.0f} | {b['itl_p50']:.1f} / {b['itl_p99']:.0f} | "
                f"{a['load1']:.1f}, {b['load1']:.1f} |")
        lines.append(f"| {k} | peak RSS MB | {ll['rss_mb']:.0f} | {cs['rss_mb']:.0f} | "
                     f"{cs['rss_mb'] / ll['rss_mb']:.2f} | | | | | |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    rows: list[dict] = []
    order = ["llama-server", "cellserve"] if not args.cellserve_first else ["cellserve", "llama-server"]
    for k in range(args.rounds):
        for kind in [o for o in order if o not in args.skip.split(",")]:
            row = one_server(kind, args, work, f"r{k}.{kind}")
            row["round"] = k
            rows.append(row)
            (work / "rows.json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    print(table(rows, args.levels))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench.side_by_side", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bpe-copy", help="copy a model folder with an ASCII byte-level BPE tokenizer")
    b.add_argument("src")
    b.add_argument("dst")
    r = sub.add_parser("run", help="alternate llama-server and cellserve under `bench serve`")
    r.add_argument("--gguf", required=True, help="the model for llama-server")
    r.add_argument("--model", required=True, help="the same model for cellserve: a folder, or the GGUF itself")
    r.add_argument("--dtype", default="float32", help="cellserve --dtype (match the GGUF's; auto serves a quantized GGUF as it is)")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--concurrency", default="1,8,32")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--min-requests", type=int, default=4, help="requests per level: max(this, 2 x clients)")
    r.add_argument("--duration", type=float, default=40.0, help="seconds per level before no new request")
    r.add_argument("--input-len", type=int, default=64)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--extra-body", default="", help="JSON merged into every request (e.g. a logit_bias)")
    r.add_argument("--port", type=int, default=8390)
    r.add_argument("--n-ctx", type=int, default=16384, help="KV budget in tokens on both (llama -c, cellserve --n-cells)")
    r.add_argument("--parallel", type=int, default=32, help="llama-server -np (its slots; -c is split among them)")
    r.add_argument("--llama-args", default="", help="more llama-server flags (e.g. '--spec-type ngram-simple')")
    r.add_argument("--cellserve-args", default="", help="more `cellserve serve` flags (e.g. '--speculative off')")
    r.add_argument("--bench-args", default="", help="more `cellserve bench serve` flags (e.g. '--workload quote "
                   "--endpoint chat')")
    r.add_argument("--lora", action="append", default=[], help="a LoRA adapter .gguf (convert_lora_to_gguf.py), "
                   "repeatable: loaded by both servers, requests alternating adapters (llama.cpp's per-request lora)")
    r.add_argument("--stop-at-eos", action="store_true", help="let answers end at EOS (default: ignore_eos)")
    r.add_argument("--skip", default="", help="server kinds not to run (llama-server or cellserve)")
    r.add_argument("--cellserve-first", action="store_true")
    r.add_argument("--out", required=True, help="folder for logs and every bench JSON")
    g = sub.add_parser("plot", help="chart of several `run` folders")
    g.add_argument("runs", nargs="+")
    g.add_argument("--png", required=True)
    args = p.parse_args(argv)
    if args.cmd == "plot":
        from server.bench.plots import plot_side_by_side  # matplotlib only for this command

        plot_side_by_side(args.runs, args.png)
        print(args.png)
        return 0
    if args.cmd == "bpe-copy":
        print(bpe_copy(Path(args.src), Path(args.dst)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
