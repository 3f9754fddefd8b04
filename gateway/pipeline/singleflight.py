"""Single-flight: concurrent identical cacheable requests make one upstream call.

The first request for a cache key leads: it goes upstream. Requests for the same key that arrive
while it is in flight follow: they wait for the leader's answer and are answered from it, as a
cache hit (streamed or not, in their own format). A leader that fails fails its followers with the
same error; a leader whose client left before the answer was complete fails them too, since there
is no complete answer to give.

A streamed leader shares its stream as it arrives (`Flight.chunks`): a streamed follower replays
what is buffered from the start, then follows live, so its first token comes when the leader's
does (pipeline/follow.py). A leader that fails mid-stream ends every such follower with the same
error event.

A finished flight lingers until the leader's answer is in the response cache (`linger`), so a
request arriving between the leader's last byte and the cache write still makes no second call.
Only exact keys join a flight; the flights live in one process (replicas do not share them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError

Answer = dict[str, Any] | None  # None: the leader gave up its flight; each follower goes on its own


@dataclass(slots=True)
class Flight:
    """One leader's upstream call, seen by its followers."""

    key: str
    future: asyncio.Future[Answer]
    num_followers: int = 0
    done: bool = field(default=False)
    # The leader's parsed stream chunks so far (None: the leader does not stream); append-only.
    chunks: list[dict[str, Any]] | None = None
    # Set, and replaced, each time `chunks` grows or the flight ends: followers wait on it.
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self) -> None:
        """Wake every follower waiting for more (new chunks, or the end)."""
        woken, self.progress = self.progress, asyncio.Event()
        woken.set()

    async def started(self) -> None:
        """Wait until the leader's stream has a first chunk, or the flight has ended."""
        while not self.done and not self.chunks:
            await self.progress.wait()


class SingleFlight:
    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}
        self.num_led = 0
        self.num_followed = 0

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, key: str) -> tuple[Flight, bool]:
        """The flight for `key` and whether the caller leads it (True) or follows (False)."""
        flight = self._flights.get(key)
        if flight is not None:
            flight.num_followers += 1
            self.num_followed += 1
            return flight, False
        flight = Flight(key, asyncio.get_running_loop().create_future())
        self._flights[key] = flight
        self.num_led += 1
        return flight, True

    async def wait(self, flight: Flight) -> Answer:
        """The leader's answer; raises (a copy of) the leader's error when it failed."""
        try:
            return await asyncio.shield(flight.future)
        except GatewayError as exc:
            raise clone_error(exc) from None

    def resolve(self, flight: Flight, answer: Answer, linger: asyncio.Future[Any] | None = None) -> None:
        """Give the followers `answer`; forget the flight now, or once `linger` (the cache write)
        has finished."""
        if flight.done:
            return
        flight.done = True
        flight.future.set_result(answer)
        flight.publish()
        if linger is None or linger.done():
            self._forget(flight)
        else:
            linger.add_done_callback(lambda _: self._forget(flight))

    def abandon(self, flight: Flight) -> None:
        """The leader became another request (compaction rewrote it): followers go upstream on
        their own rather than wait for an answer to a question they did not ask."""
        if flight.done:
            return
        flight.done = True
        flight.future.set_result(None)
        flight.publish()
        self._forget(flight)

    def fail(self, flight: Flight, error: GatewayError) -> None:
        if flight.done:
            return
        flight.done = True
        flight.future.set_exception(error)
        flight.future.exception()  # retrieved: a flight nobody followed must not warn at exit
        flight.publish()
        self._forget(flight)

    def _forget(self, flight: Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]


def clone_error(error: GatewayError) -> GatewayError:
    """The same error for another waiter: one exception object raised in many tasks would share
    (and grow) one traceback. Built without `__init__`, whose arguments differ by subclass."""
    clone = error.__class__.__new__(error.__class__)
    clone.__dict__.update(error.__dict__)
    clone.args = error.args
    return clone
