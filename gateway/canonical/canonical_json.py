"""Canonical JSON: one byte string per value, whatever the key order it arrived in."""

from __future__ import annotations

from typing import Any

import orjson


def canonical_json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def sort_keys(value: Any) -> Any:
    """The same value with every mapping's keys in sorted order (recursively). JSON serializers keep
    insertion order, so this is what makes an upstream's rendering of a schema byte-stable."""
    if isinstance(value, dict):
        return {k: sort_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys(v) for v in value]
    return value
