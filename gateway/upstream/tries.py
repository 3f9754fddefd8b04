"""What one routed request ran into on its way through the upstreams, and whose fault it was.

A 5xx answer is an outage of that upstream or a fault of the request (llama.cpp answers 500 to an
image sent to a text-only model); one answer cannot tell which, the same answer from a second
upstream can. So a 5xx is held, not counted toward the upstream's circuit breaker, until the next
upstream has answered: a success or another failure counts it, the same failure makes it the
request's (`RequestFailedUpstream`, a 400) and neither counts. 502, 503 and 504 are never taken for
the request's: they say an upstream is down, busy or behind a dead hop, and two may be at once.

A 501 says the upstream does not serve the route (llama.cpp's /v1/embeddings without
--embeddings); it counts toward nothing, the next upstream is tried, and when none serves the
route the client gets a 404 (`EndpointNotServed`), not a 5xx that it would retry.

Each attempt after a failure is a retry, counted on the upstream that failed, by cause.
"""

from __future__ import annotations

from gateway.errors import (
    EndpointNotServed,
    GatewayError,
    RequestFailedUpstream,
    UpstreamStatusError,
    UpstreamUnavailable,
)
from gateway.upstream.health import RetryCause, UpstreamHealth

NOT_IMPLEMENTED = 501
OUTAGE_STATUSES = frozenset({502, 503, 504})


class Tries:
    """The failures of one request's attempts, in order."""

    def __init__(self, health: dict[str, UpstreamHealth]) -> None:
        self._health = health
        self._held: list[UpstreamStatusError] = []  # 5xx answers not counted yet
        self._retry: tuple[str, RetryCause] | None = None  # the failure the next attempt retries
        self._not_served: dict[str, str] = {}  # upstream -> what its 501 said
        self.last: GatewayError | None = None

    def begin(self) -> None:
        """Another attempt: a retry of the failure before it, if there was one."""
        if self._retry is not None:
            name, cause = self._retry
            self._health[name].retried(cause)
            self._retry = None

    def failed(self, upstream: str, exc: GatewayError, cause: RetryCause) -> None:
        """A failure the router moves on from (a connect error: counted by the caller)."""
        exc.upstream = upstream
        self.last = exc
        self._retry = (upstream, cause)

    def not_served(self, upstream: str, message: str) -> None:
        """`upstream` does not serve the route: it answered 501 now, or did a short while ago."""
        self._not_served[upstream] = message

    def answered(self, upstream: str, exc: UpstreamStatusError) -> None:
        """A 5xx answer; RequestFailedUpstream when an earlier upstream answered the same."""
        exc.upstream = upstream
        if exc.status_code == NOT_IMPLEMENTED:
            self.not_served(upstream, exc.message)
            self._retry = (upstream, RetryCause.NOT_SERVED)
            return
        twin = next((held for held in self._held if _same_failure(held, exc)), None)
        if twin is not None:
            self._held.remove(twin)
            self.settle()
            error = RequestFailedUpstream(
                f"upstreams {twin.upstream!r} and {upstream!r} both failed this request with HTTP "
                f"{exc.status_code} ({exc.message}); a failure that repeats on a second upstream is taken "
                "for a fault of the request")
            error.upstream = upstream
            raise error from exc
        self.settle()  # a different failure: the earlier ones were the upstreams' own
        self._held.append(exc)
        self.failed(upstream, exc, RetryCause.SERVER_ERROR)

    def settle(self) -> None:
        """The held 5xx answers were the upstreams' fault: counted now."""
        for held in self._held:
            if held.upstream in self._health:
                self._health[held.upstream].record(False)
        self._held.clear()

    def error(self, model_id: str, path: str | None) -> GatewayError:
        """What the client gets when no attempt succeeded."""
        self.settle()
        if isinstance(self.last, UpstreamStatusError):
            return self.last
        error: GatewayError
        if self.last is not None:
            error = UpstreamUnavailable(self.last.message)
            error.upstream = self.last.upstream
            return error
        if self._not_served:
            names = ", ".join(repr(name) for name in self._not_served)
            reasons = "; ".join(dict.fromkeys(self._not_served.values()))
            error = EndpointNotServed(f"no upstream of model {model_id!r} serves {path or 'this route'}: "
                                      f"{names} answered 501 ({reasons})", param="model")
            error.upstream = next(reversed(self._not_served))
            return error
        return UpstreamUnavailable(f"no upstream serves {model_id!r}")


def _same_failure(a: UpstreamStatusError, b: UpstreamStatusError) -> bool:
    return (a.status_code == b.status_code and a.status_code not in OUTAGE_STATUSES
            and a.message == b.message and a.code == b.code)
