"""Per-request cache controls, from headers or from an optional `kvgate` body object.

    Cache-Control: no-cache        do not read the caches
    Cache-Control: no-store        do not write the caches
    x-kvgate-cache-namespace: NS   a separate cache space within the tenant
    x-kvgate-cache-ttl: SECONDS    lifetime of the entry this request stores
    x-kvgate-semantic: off         exact cache only
    x-kvgate-cache-mode: MODE      refresh (= write-only: read no cache, store the new answer),
                                   read-only (= no-store), off (neither), default (both)
    x-kvgate-semantic-threshold: P     a semantic hit needs the judge's probability >= P
    x-kvgate-semantic-error-bound: R   ... and >= the threshold calibrated for false-hit rate R
                                   (both only ever stricter than the deployment's setting: Bifrost's rule)

The body form is for clients that cannot set headers:
`{"kvgate": {"cache": {"no_cache": true, "no_store": true, "namespace": "NS", "ttl": 60,
"semantic": false, "mode": "refresh", "threshold": 0.9, "error_bound": 0.01}}}`. It is removed from
the body, so the upstream never sees it. A header wins
over the body when both are given. The one other key, `fuse` (marks the request's content parts as
chunks for the built-in engine's KV fusion), is left in the body as `{"kvgate": {"fuse": ...}}`
for the engine; HTTP upstreams other than kvgate engines never receive it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidField

DEFAULT_NAMESPACE = "default"
# mode -> (read, write)
MODES = {"default": (True, True), "refresh": (False, True), "write-only": (False, True),
         "read-only": (True, False), "off": (False, False)}
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")


@dataclass(slots=True, frozen=True)
class CacheControls:
    read: bool = True
    write: bool = True
    semantic: bool = True
    namespace: str = DEFAULT_NAMESPACE
    ttl_s: float | None = None
    min_probability: float | None = None
    max_false_hit_rate: float | None = None


def _flag(value: object, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {"on", "true", "1", "off", "false", "0"}:
        return value.lower() in {"on", "true", "1"}
    raise InvalidField(f"{param}: expected a boolean or on/off", param=param)


def _namespace(value: object, param: str) -> str:
    if not isinstance(value, str) or not _NAMESPACE.match(value):
        raise InvalidField(f"{param}: 1-128 characters of A-Z a-z 0-9 _ . : / -", param=param)
    return value


def _mode(value: object, param: str) -> tuple[bool, bool]:
    if not isinstance(value, str) or value not in MODES:
        raise InvalidField(f"{param}: one of {', '.join(MODES)}", param=param)
    return MODES[value]


def _ttl(value: object, param: str) -> float:
    try:
        ttl = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        ttl = math.nan
    if isinstance(value, bool) or not math.isfinite(ttl) or ttl <= 0:
        raise InvalidField(f"{param}: expected a positive number of seconds", param=param)
    return ttl


def _unit(value: object, param: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not 0.0 <= number <= 1.0:
        raise InvalidField(f"{param}: expected a number from 0 to 1", param=param)
    return number


def read_controls(headers: Mapping[str, str], body: dict[str, Any]) -> CacheControls:
    """Parse the controls, and pop the `kvgate` object from `body`."""
    extension = body.pop("kvgate", None)
    options: dict[str, Any] = {}
    if extension is not None:
        if not isinstance(extension, dict) or not extension or set(extension) - {"cache", "fuse"}:
            raise InvalidField("kvgate: expected {\"cache\": {...}} and/or {\"fuse\": ...}", param="kvgate")
        if "fuse" in extension:
            body["kvgate"] = {"fuse": extension["fuse"]}
        cache = extension.get("cache", {})
        if not isinstance(cache, dict):
            raise InvalidField("kvgate.cache: expected an object", param="kvgate.cache")
        unknown = set(cache) - {"no_cache", "no_store", "namespace", "ttl", "semantic", "mode", "threshold",
                                "error_bound"}
        if unknown:
            raise InvalidField(f"kvgate.cache: unknown option {sorted(unknown)[0]!r}", param="kvgate.cache")
        options = cache
    read, write = _mode(options.get("mode", "default"), "kvgate.cache.mode")
    read = read and not _flag(options.get("no_cache", False), "kvgate.cache.no_cache")
    write = write and not _flag(options.get("no_store", False), "kvgate.cache.no_store")
    if (value := headers.get("x-kvgate-cache-mode")) is not None:
        read, write = _mode(value.strip().lower(), "x-kvgate-cache-mode")
    semantic = _flag(options.get("semantic", True), "kvgate.cache.semantic")
    namespace = _namespace(options.get("namespace", DEFAULT_NAMESPACE), "kvgate.cache.namespace")
    ttl = _ttl(options["ttl"], "kvgate.cache.ttl") if "ttl" in options else None
    threshold = _unit(options["threshold"], "kvgate.cache.threshold") if "threshold" in options else None
    bound = _unit(options["error_bound"], "kvgate.cache.error_bound") if "error_bound" in options else None

    directives = {d.strip().lower() for d in headers.get("cache-control", "").split(",") if d.strip()}
    if "no-cache" in directives:
        read = False
    if "no-store" in directives:
        write = False
    if (value := headers.get("x-kvgate-semantic")) is not None:
        semantic = _flag(value.strip(), "x-kvgate-semantic")
    if (value := headers.get("x-kvgate-cache-namespace")) is not None:
        namespace = _namespace(value.strip(), "x-kvgate-cache-namespace")
    if (value := headers.get("x-kvgate-cache-ttl")) is not None:
        ttl = _ttl(value.strip(), "x-kvgate-cache-ttl")
    if (value := headers.get("x-kvgate-semantic-threshold")) is not None:
        threshold = _unit(value.strip(), "x-kvgate-semantic-threshold")
    if (value := headers.get("x-kvgate-semantic-error-bound")) is not None:
        bound = _unit(value.strip(), "x-kvgate-semantic-error-bound")
    return CacheControls(read=read, write=write, semantic=semantic, namespace=namespace, ttl_s=ttl,
                         min_probability=threshold, max_false_hit_rate=bound)
