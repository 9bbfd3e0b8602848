"""`python -m server.bench.spec_paired`: auto against off request by request, summarised per workload."""

import pytest

from server.bench.spec_paired import summarise_pairs


def _rec(workload, index, mode, tokens, latency, ttft, digest="d", accepted=0, rejected=0):
    return {"workload": workload, "index": index, "mode": mode, "tokens": tokens, "latency": latency,
            "ttft": ttft, "digest": digest, "accepted": accepted, "rejected": rejected}


def test_pairs_are_summed_per_mode_and_compared_request_by_request():
    records = [_rec("edit", 0, "auto", 100, 1.0, 0.2, accepted=60, rejected=20), _rec("edit", 0, "off", 100, 2.0, 0.2),
               _rec("edit", 1, "off", 50, 1.2, 0.2, digest="x"), _rec("edit", 1, "auto", 50, 1.2, 0.2, accepted=0,
                                                                      rejected=20),
               _rec("edit", 2, "auto", 80, 0.5, 0.1),  # its off half never ran: not a pair, left out
               _rec("quote", 0, "auto", 10, 0.5, 0.1), _rec("quote", 0, "off", 10, 1.0, 0.1)]
    s = summarise_pairs(records)
    edit = s["edit"]
    assert edit["requests"] == 2 and edit["same"] == 1
    assert edit["auto_tok_s"] == pytest.approx(150 / 2.2) and edit["off_tok_s"] == pytest.approx(150 / 3.2)
    assert edit["ratio"] == pytest.approx(3.2 / 2.2)
    assert edit["decode_ratios"] == pytest.approx([1.8 / 0.8, 1.0])
    assert edit["kept"] == pytest.approx(60 / 100)
    assert s["quote"]["ratio"] == pytest.approx(2.0) and s["quote"]["kept"] == 0.0
