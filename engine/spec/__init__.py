"""Speculative decoding: drafts (prompt lookup, a draft model), what a draft's length pays, and verification.

decoder.py drives it (propose before a tick, verify after its forward); lookup.py finds prompt-lookup drafts;
draft_model.py runs a smaller model of the target's vocabulary; costs.py prices a draft from measured step
times and acceptance.
"""
