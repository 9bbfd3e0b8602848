"""Structural-tag grammars (xgrammar's JSON format, sent torch-free as `GuidedDecoding` fields) shared by
the tool-call formats: each call is a tag `begin content end` whose content is the tool's arguments."""

import json


def parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def json_args(tool, style: str = "json") -> dict:
    """The arguments of one call: JSON valid against the tool's schema, at most one blank in a row."""
    out = {"type": "json_schema", "json_schema": parameters(tool), "max_whitespace_cnt": 1}
    if style != "json":
        out["style"] = style
    return out


def allowed(tools: list, choice: str | None) -> list:
    return [t for t in tools if choice is None or t.function.name == choice]


def calls_grammar(tags: list[dict], *, choice: str | None, parallel: bool, triggered: bool, trigger: str,
                  separator: str, param: str) -> dict:
    """triggered (auto): free text, and whatever follows `trigger` is a call. Else (required/named): calls
    only, at least one, `separator` between them (one only with a named choice or parallel=False)."""
    if triggered:
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
               "stop_after_first": not parallel or choice is not None}
    return structural(fmt, param)


def structural(fmt: dict, param: str) -> dict:
    return {"kind": "structural_tag", "spec": json.dumps({"type": "structural_tag", "format": fmt}), "param": param}
