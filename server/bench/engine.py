"""`cellserve bench engine`: the offline engine benchmark lives with the engine (engine/bench_engine.py);
this entry point only forwards to it, so importing server.bench never imports torch."""


def main(argv: list[str] | None = None) -> int:
    from engine.bench_engine import main as bench_engine_main

    return bench_engine_main(argv)
