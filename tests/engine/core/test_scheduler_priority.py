"""`SamplingParams.priority` in the scheduler (issue #27): waiting requests are admitted in (priority,
arrival) order, and when cells run short the running request of the highest value is preempted first,
even when it is the older one; outputs stay those of each request alone."""

from engine_support import drain, greedy, make_engine, prompt


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    engine = make_engine(max_num_seqs=1, speculative="off", prefix_caching=False)
    for rid, p in [("low", 5), ("first", 0), ("high", -3), ("second", 0)]:
        engine.add_request(rid, prompt(6, seed=len(rid)), greedy(3, priority=p))
    assert _finish_order(engine) == ["high", "first", "second", "low"]


def _preempted_run(priorities: dict[str, int]) -> tuple[list[str], dict[str, list[int]], int]:
    """"old" runs alone a few ticks, then "new" arrives; together they outgrow the pool."""
    engine = make_engine(n_cells=64, speculative="off", prefix_caching=False)
    outs: dict[str, list[int]] = {"old": [], "new": []}

    def emit(out):
        outs[out.request_id] += out.outputs[0].token_ids

    engine.add_request("old", prompt(20, seed=1), greedy(30, ignore_eos=True, priority=priorities["old"]), emit)
    order = []
    for _ in range(4):
        order += [o.request_id for o in engine.step() if o.finished]
    engine.add_request("new", prompt(20, seed=2), greedy(30, ignore_eos=True, priority=priorities["new"]), emit)
    order += _finish_order(engine)
    return order, outs, engine.stats().preemptions


def test_preemption_takes_the_lowest_priority_first():
    order, outs, preemptions = _preempted_run({"old": 0, "new": 0})
    assert preemptions > 0 and order == ["old", "new"]  # equals: the newest gives way
    order, prioritised, preemptions = _preempted_run({"old": 5, "new": 0})
    assert preemptions > 0 and order == ["new", "old"]  # the old one has the lower priority: it gives way
    assert prioritised == outs  # re-prefilled, each output is what it was
    solo = make_engine(n_cells=256, speculative="off")
    got = {}
    for rid, seed in [("old", 1), ("new", 2)]:
        solo.add_request(rid, prompt(20, seed=seed), greedy(30, ignore_eos=True),
                         lambda out: got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids))
        drain(solo)
    assert got == outs
