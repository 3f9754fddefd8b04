"""llama.cpp slot KV in kvgate's tiers, against real llama-server processes (gateway/slots).

Each conversation here has a system prompt of a few hundred tokens, so that a prefill from nothing
and a restore differ plainly in `cached_tokens` (what the server itself reports) without the test
taking long on one CPU thread per server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.llama_servers import LlamaServer
from gateway.pipeline.call import tenant_salt
from gateway.slots.keeper import SlotKeeper
from tests.conftest import ADMIN_SECRET
from tests.llamacpp.conftest import kvgate_in_front

ROUND_ROBIN = {"strategy": "round_robin"}


def system_prompt(topic: str, sentences: int = 24) -> str:
    facts = [f"Fact {i} about {topic}: item {i} of the {topic} list weighs {i * 7 % 23} units and is "
             f"filed under shelf {i * 3 % 11}." for i in range(sentences)]
    return f"You are the archivist of the {topic} collection. " + " ".join(facts)


def conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt(topic)},
            {"role": "user", "content": f"What is the {topic} collection?"}]


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt_tokens(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens"])


def next_turn(messages: list[dict[str, str]], response: httpx.Response, question: str) -> list[dict[str, str]]:
    answer = response.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def test_a_slot_saved_on_one_server_is_restored_on_another(
        llama_servers: Callable[..., list[LlamaServer]], tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1)
    with kvgate_in_front(servers, tmp_path, routing=ROUND_ROBIN) as front:
        messages = conversation("harbour")
        first = front.chat(messages)
        assert cached(first) == 0
        assert "restored" not in first.headers["x-kvgate-kv-slot"]
        front.wait_saves(1)
        # Round robin sends the second turn to the other server, which has never seen this prompt.
        messages = next_turn(messages, first, "And how heavy is item 5?")
        second = front.chat(messages)
        where = second.headers["x-kvgate-kv-slot"]
        assert where.split("#")[0] != first.headers["x-kvgate-kv-slot"].split("#")[0]
        assert where.endswith("restored=host"), where
        # The server itself reports what it did not prefill: at least the whole first prompt.
        assert cached(second) >= prompt_tokens(first), second.json()["usage"]
        assert front.keeper.stats.restores.get((where.split("#")[0], "restored")) == 1
        assert second.json()["choices"][0]["message"]["content"]
        front.wait_saves(2)
        # The dashboard's KV tiers table and the metrics show the files kept: one, since the second
        # turn's file covers every block of the first's and replaced it.
        admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
        summary = httpx.get(front.url + "/dashboard/api/summary", headers=admin, timeout=30).json()
        [host] = [row for row in summary["kv_tiers"] if row["name"] == "llama.cpp slots: host"]
        assert host["files"] == 1 and host["used_bytes"] > 0 and host["hits"] == 1
        metrics = httpx.get(front.url + "/metrics", headers=admin, timeout=30).text
        assert 'kvgate_slot_files{tier="host"} 1.0' in metrics
        assert 'kvgate_slot_restores_total{outcome="restored",upstream="' in metrics


def test_a_returning_conversation_goes_to_the_slot_that_holds_it(
        llama_servers: Callable[..., list[LlamaServer]], tmp_path: Path) -> None:
    servers = llama_servers(2, slots=2)
    with kvgate_in_front(servers, tmp_path, slots={"host_mb": 0}) as front:  # no files: routing alone
        topics = ["orchard", "lighthouse", "glacier"]
        talks = {t: conversation(t) for t in topics}
        firsts = {t: front.chat(talks[t]) for t in topics}
        assert len({firsts[t].headers["x-kvgate-kv-slot"] for t in topics}) == 3
        for topic in reversed(topics):
            talks[topic] = next_turn(talks[topic], firsts[topic], "Which shelf holds item 3?")
            again = front.chat(talks[topic])
            assert again.headers["x-kvgate-kv-slot"] == firsts[topic].headers["x-kvgate-kv-slot"]
            assert cached(again) >= prompt_tokens(firsts[topic])


def test_a_damaged_slot_file_is_dropped_and_the_request_answered(
        llama_servers: Callable[..., list[LlamaServer]], tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1)
    slots = {"host_mb": 0, "disk_dir": str(tmp_path / "slot-files")}
    with kvgate_in_front(servers, tmp_path, routing=ROUND_ROBIN, slots=slots) as front:
        messages = conversation("quarry")
        first = front.chat(messages)
        front.wait_saves(1)
        [kept] = list((tmp_path / "slot-files").glob("*.slot"))
        blob = bytearray(kept.read_bytes())
        middle = len(blob) // 2
        blob[middle:middle + 64] = bytes(64)  # part of the KV overwritten, as a bad disk would
        kept.write_bytes(bytes(blob))
        second = front.chat(next_turn(messages, first, "Which shelf holds item 2?"))
        assert "restored" not in second.headers["x-kvgate-kv-slot"]
        assert cached(second) == 0  # prefilled from nothing on the other server, not from a damaged file
        assert second.json()["choices"][0]["message"]["content"]
        assert front.keeper.store is not None and front.keeper.store.corrupt == 1
        assert not kept.exists()


def test_a_file_the_server_refuses_falls_back_to_a_plain_request(
        llama_servers: Callable[..., list[LlamaServer]], tmp_path: Path) -> None:
    """A file whose checksum holds but which llama.cpp cannot load (another llama.cpp version or
    model): the restore fails, the request is answered from a plain prefill."""
    servers = llama_servers(1, slots=1)
    with kvgate_in_front(servers, tmp_path) as front:
        messages = conversation("vineyard")
        keeper = front.keeper
        store = keeper.store
        assert store is not None
        body = {"model": front.model, "messages": messages, "max_tokens": 8, "temperature": 0}
        blocks = front.app.state.services.proxy._preparer.prepare("team-llama", body, chat=True, session=None).blocks
        server = keeper.servers()[0]
        keys = SlotKeeper.keys(server, blocks, tenant_salt("team-llama"))
        store.put(keys[-1].hex(), b"not a llama.cpp slot file" * 1000, keys)
        answer = front.chat(messages)
        assert answer.json()["choices"][0]["message"]["content"]
        assert "restored" not in answer.headers["x-kvgate-kv-slot"]
        assert keeper.stats.restores.get((server.backend.name, "failed")) == 1


def test_a_conversation_whose_server_dies_continues_on_another_from_the_tiers(
        llama_servers: Callable[..., list[LlamaServer]], tmp_path: Path) -> None:
    servers = llama_servers(2, slots=1)
    routing: dict[str, Any] = {"connect_retries": 0}
    with kvgate_in_front(servers, tmp_path, routing=routing) as front:
        messages = conversation("canyon")
        first = front.chat(messages)
        front.wait_saves(1)
        went = first.headers["x-kvgate-kv-slot"].split("#")[0]
        next(s for s in servers if s.name == went).kill()  # no warning, between two turns
        messages = next_turn(messages, first, "Which shelf holds item 7?")
        second = front.chat(messages)
        where = second.headers["x-kvgate-kv-slot"]
        assert where.split("#")[0] != went and where.endswith("restored=host"), where
        print(f"after the kill: cached_tokens {cached(second)} of {prompt_tokens(second)} prompt tokens")
        assert cached(second) >= 0.9 * prompt_tokens(second), second.json()["usage"]
