"""`cellserve bench serve`: a client-side load generator for any OpenAI-compatible server.

It targets cellserve, llama.cpp's `llama-server`, `transformers serve`, vLLM or SGLang alike: it
only speaks HTTP (httpx) and never imports torch; of `engine/` it imports only the torch-free
`engine.bench.machine` (the one machine description every benchmark saves), and only when a run
ends. Modules, one concern each:

- `records`   the per-request record every measurement is computed from
- `sse`       a small server-sent-events decoder
- `workloads` prompt generators (random, shared-prefix, fork-tree)
- `arrivals`  Poisson / gamma inter-arrival gaps for open-loop runs
- `client`    one streamed request -> one record
- `forktree`  cellserve's stateful-sequence workload (create, fork, continue, delete)
- `jobs`      a workload turned into the runner's unit of work
- `runner`    closed-loop and open-loop drivers with a live progress bar
- `metrics`   TTFT / TPOT / ITL / E2E statistics, throughput, goodput, errors
- `report`    the summary table and the JSON results file
- `plots`     PNG charts (matplotlib, Agg), `compare`'s too
- `serve`     the command line: `main(argv)` and `add_parser(subparsers)`
- `compare`   `cellserve bench compare`: several `serve` results side by side
- `overhead`  `cellserve bench overhead`: a real server against the offline engine (run as processes)
- `scaleout`  `python -m server.bench.scaleout`: the single server against `--replicas` layouts (Ray Serve)

`cellserve bench engine` is the engine's own benchmark (engine/bench/engine.py), dispatched by server/cli.py.
"""
