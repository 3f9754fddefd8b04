"""Faults under load, in containers: the compose stack (with the test override's stand-ins), two
gateway replicas behind the load balancer, 64 clients of the openai SDK with its default retries (half
streaming) asking SQuAD questions for 3 minutes, and on a schedule: SIGKILL a gateway replica (started
again 5 s later, as a supervisor would), stop one with SIGTERM and start it again (`docker restart`),
restart Redis, restart PostgreSQL, SIGKILL an engine (started again 5 s later). Per fault: requests
in flight at that moment, requests that failed after the SDK's retries, request-log rows missing for
answered requests, wrong answers (a cached answer that no upstream call gave for that question), and
how long until every request sent after the fault was answered (the end of the last one that failed).

    deploy/build-images && python -m tests.deploy.chaos [--seconds 180] [--clients 64] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.stack import MODEL, ROOT, Stack, eventually

SCHEDULE = (("SIGKILL a gateway replica", 0.15), ("SIGTERM a gateway replica", 0.32), ("restart Redis", 0.49),
            ("restart PostgreSQL", 0.66), ("SIGKILL an engine", 0.83))  # at these fractions of the run
CACHE = "x-kvgate-cache"


@dataclass(slots=True)
class Call:
    question: str
    started: float
    ended: float = 0.0
    ok: bool = False
    request_id: str = ""
    cache: str = ""
    answer: str = ""
    error: str = ""


def questions(run: str, count: int = 240) -> list[str]:
    seen: list[str] = []
    with gzip.open(ROOT / "bench" / "data" / "squad2_dev_5articles.jsonl.gz", "rt") as rows:
        for row in rows:
            for qa in json.loads(row)["qas"]:
                if qa["question"] not in seen:
                    seen.append(qa["question"])
    return [f"{q} (run {run})" for q in seen[:count]]


def client_loop(stack: Stack, asked: list[str], index: int, until: float, calls: list[Call]) -> None:
    sdk = openai.OpenAI(base_url=stack.lb_url + "/v1", api_key=stack.admin_key, timeout=60)  # default retries
    stream, n = index % 2 == 1, index
    while time.monotonic() < until:
        question = asked[n % len(asked)]
        n += 7
        call = Call(question, time.monotonic())
        messages = [{"role": "user", "content": question}]
        try:
            if stream:
                create = sdk.chat.completions.with_streaming_response.create
                with create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True) as raw:  # type: ignore[arg-type]
                    call.request_id, call.cache = raw.headers.get("x-request-id", ""), raw.headers.get(CACHE, "")
                    call.answer = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            else:
                raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                                    temperature=0)
                call.request_id, call.cache = raw.headers.get("x-request-id", ""), raw.headers.get(CACHE, "")
                call.answer = raw.parse().choices[0].message.content or ""
            call.ok = True
        except openai.APIError as exc:
            call.ok, call.error = False, f"{type(exc).__name__}: {str(exc)[:80]}"
        call.ended = time.monotonic()
        calls.append(call)


def in_flight_on(stack: Stack, fault: str) -> int | None:
    """Requests the process about to be killed or stopped is serving (its gateway's upstream calls in
    flight, or the engine's in every gateway), read off /metrics just before; None for a restart."""
    if not fault.startswith("SIG"):
        return None
    gateways = [stack.gateway_urls()[0]] if "gateway" in fault else stack.gateway_urls()
    total = 0.0
    for url in gateways:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {stack.metrics_key}"}, timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name == "kvgate_upstream_in_flight_requests":
                total += sum(s.value for s in family.samples
                             if "gateway" in fault or s.labels["upstream"] == "engine-1")
    return int(total)


def inject(stack: Stack, fault: str) -> None:
    if fault == "restart Redis":
        subprocess.run(["docker", "restart", stack.container("redis")], check=True, capture_output=True)
    elif fault == "restart PostgreSQL":
        subprocess.run(["docker", "restart", stack.container("postgres")], check=True, capture_output=True)
    else:
        # the replica in_flight_on read: the first by address
        victim = (next(c for c in stack.compose("ps", "-q", "gateway").stdout.split()
                       if f"http://{stack.address(c)}:8080" == stack.gateway_urls()[0])
                  if "gateway" in fault else stack.container("engine-1"))
        if fault.startswith("SIGTERM"):  # a graceful stop (10 s before Docker sends SIGKILL), then a start
            subprocess.run(["docker", "restart", victim], check=True, capture_output=True)
            return
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
        time.sleep(5)
        subprocess.run(["docker", "start", victim], check=True, capture_output=True)


def logged_ids(stack: Stack) -> set[str]:
    out = stack.compose("exec", "-T", "postgres", "psql", "-U", "kvgate", "-d", "kvgate", "-At", "-c",
                        "SELECT request_id FROM request_log").stdout
    return set(out.split())


def run(stack: Stack, seconds: float, clients: int) -> list[dict[str, Any]]:
    asked = questions(uuid.uuid4().hex[:8])
    calls: list[Call] = []
    start = time.monotonic()
    until = start + seconds
    threads = [threading.Thread(target=client_loop, args=(stack, asked, i, until, calls), daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    faults: list[tuple[str, float]] = []
    killed_in_flight: list[int | None] = [None]
    for fault, at in SCHEDULE:
        time.sleep(max(0.0, start + at * seconds - time.monotonic()))
        killed_in_flight.append(in_flight_on(stack, fault))
        faults.append((fault, time.monotonic()))
        inject(stack, fault)
    for thread in threads:
        thread.join()
    time.sleep(10)  # the request log writes in batches
    logged = logged_ids(stack)
    upstream_answers: dict[str, set[str]] = defaultdict(set)
    for call in calls:
        if call.ok and not call.cache.startswith("hit"):
            upstream_answers[call.question].add(call.answer)
    rows = []
    bounds = [start] + [at for _, at in faults] + [until + 60]
    for i, (fault, at) in enumerate([("(no fault)", start), *faults]):
        window = [c for c in calls if bounds[i] <= c.ended < bounds[i + 1]]
        failed = [c for c in window if not c.ok]
        rows.append({
            "fault": fault, "at_s": round(at - start, 1), "requests": len(window),
            "in_flight": sum(1 for c in calls if c.started <= at < c.ended) if i else 0,
            "in_flight_on_killed": killed_in_flight[i],
            "failed": len(failed),
            "rows_lost": sum(1 for c in window if c.ok and c.request_id and c.request_id not in logged),
            "wrong": sum(1 for c in window if c.ok and c.cache.startswith("hit")
                         and c.answer not in upstream_answers[c.question]),
            # until requests sent after the fault all succeed: the end of the last one that failed
            "errors": dict(Counter(c.error for c in failed).most_common(3)),
            "serving_again_s": round(max((c.ended for c in failed if c.started >= at), default=at) - at, 1)
            if i else 0.0,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| fault | at s | requests | in flight at the fault (on the killed process) | failed after retries "
             "| request-log rows lost | wrong answers | every new request answered again after s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['fault']} | {r['at_s']} | {r['requests']} | {r['in_flight']} ({r['in_flight_on_killed'] or '-'}) "
              f"| {r['failed']} | {r['rows_lost']} | {r['wrong']} | {r['serving_again_s']} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stack = Stack("kvgatechaos")
    stack.compose("down", "-v", "--remove-orphans", check=False)
    try:
        stack.compose("up", "-d", "--no-build", "--scale", "gateway=2")
        eventually(lambda: stack.healthy("gateway") and len(stack.gateway_urls()) == 2
                   and httpx.get(stack.lb_url + "/readyz", timeout=5).status_code == 200, 300, "the stack up")
        rows = run(stack, args.seconds, args.clients)
    finally:
        stack.compose("down", "-v", "--remove-orphans", check=False)
    print(json.dumps(rows) if args.json else table(rows))
    if not args.json:
        for row in rows:
            for error, count in row["errors"].items():
                print(f"{row['fault']}: {count} x {error}")


if __name__ == "__main__":
    main()
