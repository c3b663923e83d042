"""serve's periodic provider probes (DESIGN.md §12): every `probe_interval`, for every
provider that sets one, the probe of probe.py (never MAIL). Each change of readiness is
reported to the server (route, `smtpguard_provider_ready`, the store for `stats`); a
provider that turns not ready is logged at warning with the reply it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping

from smtpguard.background import keep
from smtpguard.config import Config, SmtpProviderConfig
from smtpguard.policy.readiness import judge_probe
from smtpguard.readiness.probe import probe_smtp

log = logging.getLogger("smtpguard.readiness")

OnChange = Callable[[str, bool, str], None]
JITTER = 0.1
"""Each wait is the interval ±10%, at random: instances started together (a deploy, a
restart of every machine) do not keep logging in to the provider at the same moment."""


def jittered(interval: float, rng: random.Random | None = None) -> float:
    return interval * (1 + (rng or random).uniform(-JITTER, JITTER))


class Prober:
    def __init__(
        self,
        config: Config,
        secrets: Mapping[str, str | None],
        helo: str,
        on_change: OnChange,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._targets = [
            p for p in config.providers if isinstance(p, SmtpProviderConfig) and p.probe_interval is not None
        ]
        self._secrets = secrets
        self._helo = helo
        self._on_change = on_change
        self._wall_clock = wall_clock
        """Certificates expire on the calendar, whatever clock the store keeps."""
        self._tasks: list[asyncio.Task[None]] = []
        self.ready: dict[str, bool] = {}
        self.detail: dict[str, str] = {}
        """The last probe's detail per provider."""
        self.probes = 0
        self.probed = asyncio.Event()
        self._stopping = asyncio.Event()
        """Set after each probe (tests wait on it instead of polling)."""

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(p)) for p in self._targets]

    async def _loop(self, cfg: SmtpProviderConfig) -> None:
        assert cfg.probe_interval is not None
        warned_expiry = False
        while not self._stopping.is_set():
            try:
                result = await probe_smtp(cfg, self._secrets.get(cfg.name), self._helo)
            except Exception as e:  # a defect in the probe must not end the loop
                log.error("provider probe raised", exc_info=e, extra={"provider": cfg.name})
                await self._pause(cfg.probe_interval)
                continue
            if self._stopping.is_set():
                # The SMTP client can swallow the cancellation of a probe under way, which
                # then finishes: a stopped prober (replaced by a reload) reports nothing.
                return
            self.probes += 1
            self.probed.set()
            status, detail = judge_probe(result, self._wall_clock())
            ready = status != "error"
            before = self.ready.get(cfg.name)
            reason_before = self.detail.get(cfg.name)
            self.ready[cfg.name] = ready
            self.detail[cfg.name] = detail
            # Published on a change of readiness, and of the reason while not ready (AUTH
            # refused, then connect refused: `stats` must show the current one).
            if before is not ready or (not ready and detail != reason_before):
                if not ready:
                    log.warning(
                        "provider not ready: %s",
                        detail,
                        extra={"provider": cfg.name, "probe": detail},
                    )
                elif before is False:
                    log.info("provider ready again", extra={"provider": cfg.name, "probe": detail})
                self._on_change(cfg.name, ready, detail)
            if status == "warning" and not warned_expiry:
                log.warning("provider certificate: %s", detail, extra={"provider": cfg.name})
            warned_expiry = status == "warning"
            await self._pause(cfg.probe_interval)

    async def _pause(self, interval: float) -> None:
        """Until the next probe, or until stop(), whichever comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), jittered(interval))

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def stop_later(self, background: set[asyncio.Task[None]]) -> None:
        """Stop without waiting (a reload replaces the prober): kept in `background` so the
        server's stop still waits for it."""
        keep(background, self.stop())
