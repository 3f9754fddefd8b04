"""Limits counted in Redis, shared by every replica: one script checks every scope and counts the
request in all of them or none (`admit`), one more charges tokens and cost and releases the lease
after the answer (`finish`). The counts are those of gateway/limits/counters.py."""

from __future__ import annotations

import asyncio

from gateway.limits.counters import LEASE_TTL_S, Refusal, Scope, SpendLedger, Used
from gateway.limits.policy import minute_window
from gateway.limits.resp import FastRedis

# One round trip per request: check every scope, then count the request and its lease in all of
# them, or in none. KEYS: 4 per scope (requests this minute, tokens this minute, leases, spend this
# period). ARGV: now_ms, lease, lease_ttl_ms, then 4 per scope (rpm, tpm, parallel, budget; -1 for
# none). Returns {1, requests, tokens, parallel, spend, ...} per scope, {0, scope, kind, used}
# refused, or {2, scope}: that scope's spend is not in Redis, seed it from the request log first.
_ADMIT = """
local now = tonumber(ARGV[1])
local used = {}
for i = 0, #KEYS / 4 - 1 do
  local k, a = i * 4, 3 + i * 4
  local rpm, tpm, par, budget = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), ARGV[a + 4]
  local requests = tonumber(redis.call('GET', KEYS[k + 1]) or '0')
  local tokens = tonumber(redis.call('GET', KEYS[k + 2]) or '0')
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now)
  local parallel = redis.call('ZCARD', KEYS[k + 3])
  local spend = '0'
  if budget ~= '-1' then
    spend = redis.call('GET', KEYS[k + 4])
    if not spend then return {2, i} end
    if tonumber(spend) >= tonumber(budget) then return {0, i, 'budget', spend} end
  end
  if rpm >= 0 and requests >= rpm then return {0, i, 'requests', tostring(requests)} end
  if tpm >= 0 and tokens >= tpm then return {0, i, 'tokens', tostring(tokens)} end
  if par >= 0 and parallel >= par then return {0, i, 'parallel', tostring(parallel)} end
  table.insert(used, requests); table.insert(used, tokens); table.insert(used, parallel); table.insert(used, spend)
end
for i = 0, #KEYS / 4 - 1 do
  local k = i * 4
  redis.call('INCR', KEYS[k + 1])
  redis.call('EXPIRE', KEYS[k + 1], 120)
  if tonumber(ARGV[3 + i * 4 + 3]) >= 0 then
    redis.call('ZADD', KEYS[k + 3], now + tonumber(ARGV[3]), ARGV[2])
    redis.call('PEXPIRE', KEYS[k + 3], tonumber(ARGV[3]))
  end
end
return {1, unpack(used)}
"""
# After the answers, one round trip for every request finished in the last few milliseconds: charge
# tokens and cost to each scope and release each lease. KEYS: 3 per scope of each request (tokens
# this minute, leases, spend this period or ''); ARGV: 3 beside each (tokens, cost, lease; '' when
# released already). Spend is added only to a period already seeded (else the seed, read from the
# request log later, holds it).
_FINISH = """
for k = 1, #KEYS, 3 do
  local tokens, cost, lease = tonumber(ARGV[k]), tonumber(ARGV[k + 1]), ARGV[k + 2]
  if tokens > 0 then
    redis.call('INCRBY', KEYS[k], tokens)
    redis.call('EXPIRE', KEYS[k], 120)
  end
  if lease ~= '' then redis.call('ZREM', KEYS[k + 1], lease) end
  if KEYS[k + 2] ~= '' and cost > 0 and redis.call('EXISTS', KEYS[k + 2]) == 1 then
    redis.call('INCRBYFLOAT', KEYS[k + 2], ARGV[k + 1])
  end
end
return 1
"""
# How long finished requests wait to be sent together, and how many at most.
FINISH_BATCH_S = 0.005
FINISH_BATCH_MAX = 64


class RedisCounters:
    """Counts in Redis, shared by every replica (one plain Redis; limits do not use Redis Cluster,
    whose scripts cannot span slots)."""

    def __init__(self, url: str, ledger: SpendLedger, prefix: str = "kvgate:limits:") -> None:
        self._redis = FastRedis(url)  # gateway/limits/resp.py says why not redis-py
        self._ledger = ledger
        self._prefix = prefix
        self._admit = self._redis.script(_ADMIT)
        self._finish = self._redis.script(_FINISH)
        self._finished_keys: list[str] = []  # of requests finished, not yet sent (`_send_finished`)
        self._finished_args: list[str | int] = []
        self._flush: asyncio.TimerHandle | None = None

    def _keys(self, scope: Scope, now: float) -> list[str]:
        minute, _ = minute_window(now)
        base = self._prefix + scope.name
        spend = ""
        if scope.limits.budget_usd is not None:
            spend = f"{base}:s:{int(scope.limits.budget_window(now)[0])}"
        return [f"{base}:r:{minute}", f"{base}:t:{minute}", f"{base}:p", spend]

    async def admit(self, scopes: list[Scope], lease: str, now: float) -> list[Used] | Refusal:
        keys: list[str] = []
        args: list[object] = [int(now * 1000), lease, LEASE_TTL_S * 1000]
        for scope in scopes:
            keys += self._keys(scope, now)
            limits = scope.limits
            args += [_or_none(limits.rpm), _or_none(limits.tpm), _or_none(limits.max_parallel),
                     _or_none(limits.budget_usd)]
        while True:
            reply = await self._redis.evalsha(self._admit, keys, args)
            if reply[0] != 2:
                break
            scope = scopes[int(reply[1])]
            start, end = scope.limits.budget_window(now)
            spent = await self._ledger.spent(scope, start)
            # NX: another replica may have seeded it (and charged it) meanwhile.
            await self._redis.call("SET", keys[int(reply[1]) * 4 + 3], repr(spent), "NX", "EX",
                                   max(60, int(end - now) + 86_400))
        if reply[0] == 0:
            scope, kind = scopes[int(reply[1])], reply[2].decode()
            return Refusal(scope, kind, _limit_of(scope, kind), float(reply[3]))
        values = reply[1:]
        return [Used(int(values[i]), int(values[i + 1]), int(values[i + 2]), float(values[i + 3]))
                for i in range(0, len(values), 4)]

    def finish(self, scopes: list[Scope], lease: str | None, tokens: int, cost_usd: float, now: float) -> None:
        if tokens <= 0 and cost_usd <= 0 and not any(s.limits.max_parallel is not None for s in scopes):
            return
        for scope in scopes:
            _, tokens_key, leases, spend = self._keys(scope, now)
            self._finished_keys += [tokens_key, leases, spend]
            self._finished_args += [tokens, repr(cost_usd), lease or ""]
        if len(self._finished_keys) >= 3 * FINISH_BATCH_MAX:
            self._send_finished()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(FINISH_BATCH_S, self._send_finished)

    def _send_finished(self) -> None:
        """One script call for the requests finished since the last (a lease freed a few ms late)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._finished_keys:
            keys, args = self._finished_keys, self._finished_args
            self._finished_keys, self._finished_args = [], []
            self._redis.fire("EVALSHA", self._finish, len(keys), *keys, *args)

    async def aclose(self) -> None:
        self._send_finished()
        await self._redis.aclose()


def _or_none(value: float | None) -> object:
    return -1 if value is None else (repr(float(value)) if isinstance(value, float) else value)


def _limit_of(scope: Scope, kind: str) -> float:
    limits = scope.limits
    value = {"requests": limits.rpm, "tokens": limits.tpm, "parallel": limits.max_parallel,
             "budget": limits.budget_usd}[kind]
    return float(value or 0)


