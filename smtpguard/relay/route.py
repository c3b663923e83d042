"""The route: which provider carries a message, in what order, and what the walk ends with
(DESIGN.md §6, §12, §16). What each answer means and when the next provider may be tried is
policy/failover.py's; this module asks the gate and the providers, and carries it out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from smtpguard.policy.breaker import Breaker, Circuit
from smtpguard.policy.failover import (
    Attempted,
    Health,
    Walk,
    after_retry,
    health_after,
    reply_class,
    retries_same,
)
from smtpguard.policy.outcome import Outcome
from smtpguard.policy.share import Candidate, shared_provider, slot
from smtpguard.policy.throttle import CONNECTION_WAIT, zone_route
from smtpguard.provider_gate import ProviderGate
from smtpguard.relay.base import BeforeData, Envelope, MarkSent, Provider

log = logging.getLogger("smtpguard.relay")


class Route:
    """Primary, then standby (then more), skipping open circuits (DESIGN.md §6); a standby
    with a `share` heads the route for that share of event keys while it is ready (§12).
    A zone with its own `providers` walks those instead (§16), and the gate skips a
    provider that is throttled or out of max_rate/max_connections slots without counting
    it against its circuit."""

    def __init__(
        self,
        providers: Sequence[Provider],
        threshold: int,
        cooldown: float,
        clock: Callable[[], float] = time.time,
        observe: Callable[[str, str, float], None] | None = None,
        on_circuit: Callable[[str, Circuit], None] | None = None,
        shares: Mapping[str, float] | None = None,
        gate: ProviderGate | None = None,
        zone_routes: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.providers = list(providers)
        self.gate = gate
        self.zone_routes: dict[str, list[Provider]] = {}
        """Each zone's own route (`zones.Z.providers`), resolved to providers."""
        self.set_zone_routes(zone_routes or {})
        self.breakers = {p.name: Breaker(threshold, cooldown) for p in self.providers}
        self.shares = {name: share for name, share in (shares or {}).items() if share > 0}
        self.ready: dict[str, bool] = {}
        """Each probed provider's last probe (serve's prober writes it). A provider never
        probed is not ready: no share goes to a standby that has not answered."""
        self._clock = clock
        self._observe = observe
        self._on_circuit = on_circuit
        if on_circuit is not None:
            for name, b in self.breakers.items():
                on_circuit(name, b.circuit)

    def set_zone_routes(self, zone_routes: Mapping[str, Sequence[str]]) -> None:
        """Resolve the zones' own routes against these providers (at start, and on a reload
        that changes only `zones.Z.providers`, which keeps the pools and circuits)."""
        by_name = {p.name: p for p in self.providers}
        self.zone_routes = {
            zone: [by_name[n] for n in zone_route(list(by_name), list(names))]
            for zone, names in zone_routes.items()
        }

    def providers_for(self, zone: str) -> list[Provider]:
        """The providers a zone's mail may go to: its own route, else the top-level one."""
        own = self.zone_routes.get(zone)
        return own if own is not None else self.providers

    async def close(self) -> None:
        for p in self.providers:
            await p.close()

    def circuits(self) -> dict[str, Circuit]:
        return {name: b.circuit for name, b in self.breakers.items()}

    def any_closed(self) -> bool:
        return any(b.circuit is not Circuit.OPEN for b in self.breakers.values())

    def order(self, env: Envelope) -> list[Provider]:
        """The providers to try, in order, for this envelope. The shared standby is picked by
        zone and key (policy/share.py), so a retry of the event heads the same route; it must
        be ready and its circuit closed, else the normal route. Failover from it walks the
        rest of the route in its configured order. A zone's own route is walked as written:
        the operator chose it, so no share reorders it."""
        own = self.zone_routes.get(env.zone)
        if own is not None:
            return own
        if not self.shares or env.key is None:
            return self.providers
        candidates = [
            Candidate(
                p.name,
                self.shares[p.name],
                self.ready.get(p.name, False) and self.breakers[p.name].circuit is Circuit.CLOSED,
            )
            for p in self.providers[1:]
            if p.name in self.shares
        ]
        name = shared_provider(slot(env.zone, env.key), candidates)
        if name is None:
            return self.providers
        chosen = next(p for p in self.providers if p.name == name)
        return [chosen, *(p for p in self.providers if p is not chosen)]

    async def blocked_until(self, zone: str) -> float | None:
        """When the zone's route is usable again, if every provider on it is throttled now
        (the queue holds the zone's entries until then); None when one is usable."""
        if self.gate is None:
            return None
        return await self.gate.blocked_route(p.name for p in self.providers_for(zone))

    async def send(self, env: Envelope, before_data: MarkSent) -> Outcome:
        walk = Walk()
        return walk.end(await self._walk(env, before_data, walk))

    async def _walk(self, env: Envelope, before_data: MarkSent, walk: Walk) -> Outcome:
        gate = self.gate
        for p in self.order(env):
            if gate is not None:
                until = await gate.blocked(p.name)
                if until is not None:
                    walk.throttled(until)
                    continue
            allowed, self.breakers[p.name] = self.breakers[p.name].allow(self._clock())
            if not allowed:
                walk.circuit_open()
                continue
            try:
                if gate is not None:
                    # A throttle learnt while this one waited for its slot holds it too.
                    until = await gate.admit(p.name) or gate.throttled_until(p.name)
                    if until is not None:
                        self.breakers[p.name] = self.breakers[p.name].release_probe()
                        walk.throttled(until)
                        continue
                result = await self._attempt(p, env, _noting(before_data, p))
                if result.rate_limited:
                    if gate is not None:
                        walk.throttled(await gate.throttle(p.name, result.outcome.reply))
                    else:
                        walk.throttled(self._clock())
                elif result.busy:
                    walk.throttled(self._clock() + CONNECTION_WAIT)
                self._record_health(p.name, result.health)
                if retries_same(result, p.idempotent):
                    log.warning(
                        "retrying unknown outcome once on idempotent provider",
                        extra={"provider": p.name, "zone": env.zone},
                    )
                    retry = await self._attempt(p, env, _noop)
                    self._record_health(p.name, retry.health)
                    result = after_retry(result, retry)
            except BaseException:
                self.breakers[p.name] = self.breakers[p.name].release_probe()
                raise
            ended = walk.tried(result)
            if ended is not None:
                return ended
        return walk.exhausted()

    async def _attempt(self, p: Provider, env: Envelope, before_data: BeforeData) -> Attempted:
        started = time.perf_counter()
        result = await p.send(env, before_data)
        if self._observe is not None:
            self._observe(p.name, reply_class(result.outcome), time.perf_counter() - started)
        return result

    def _record_health(self, name: str, health: Health) -> None:
        before = self.breakers[name]
        after = health_after(before, health, self._clock())
        self.breakers[name] = after
        if after.circuit is not before.circuit:
            if self._on_circuit is not None:
                self._on_circuit(name, after.circuit)
            level = logging.WARNING if after.circuit is Circuit.OPEN else logging.INFO
            log.log(
                level,
                "provider circuit %s",
                after.circuit.value,
                extra={"provider": name, "circuit": after.circuit.value},
            )


async def _noop() -> None:
    return None


def _noting(mark: MarkSent, provider: Provider) -> BeforeData:
    async def before_data() -> None:
        await mark(provider)

    return before_data
