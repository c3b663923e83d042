"""The run of one smtpguard process: its event loop, the signals it answers (SIGTERM and
SIGINT stop it, SIGHUP or, in a worker, SIGUSR1 reloads) and systemd's notifications."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from smtpguard import notify
from smtpguard.background import keep
from smtpguard.config import Config, ConfigError
from smtpguard.server import Server
from smtpguard.server.event_loop import loop_factory

if TYPE_CHECKING:
    from smtpguard.workers import WorkerRole

log = logging.getLogger("smtpguard.server")


def serve(config: Config, config_path: Path | None, role: WorkerRole | None = None) -> None:
    """Run until SIGTERM or SIGINT, on the configured event loop."""
    new_loop = loop_factory(config.event_loop)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(run(config, config_path, role))


async def run(config: Config, config_path: Path | None, role: WorkerRole | None = None) -> None:
    server = Server(config, config_path, role=role)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        # Once STOPPING=1 is sent, systemd hears no more of reloads: a READY=1 after it
        # would tell it the stopping unit is running again.
        if not server.draining:
            notify.reloading()
        try:
            await server.reload()
        finally:
            if not server.draining:
                notify.ready(f"serving {len(server.config.zones)} zone(s)")

    def on_hup() -> None:
        keep(reloads, reload())

    if role is None:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    else:
        # The supervisor checks the file and sends SIGUSR1; a SIGHUP sent to the whole
        # process group must not make every worker reload (or refuse) on its own too.
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
        loop.add_signal_handler(signal.SIGUSR1, on_hup)
        role.mark_ready()
    # systemd (Type=notify) starts the units ordered after this one only now: listeners,
    # store and metrics are up.
    notify.ready(f"serving {len(config.zones)} zone(s)")
    waiters = [
        asyncio.create_task(stop.wait()),
        asyncio.create_task(server.unfit_event.wait()),
        asyncio.create_task(server.orphaned.wait()),
    ]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if role is not None:
        # A worker hears SIGTERM twice (from the process group, then from its supervisor):
        # the second must not kill the drain, nor the exit after it.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    notify.stopping()
    log.info("stopping: no new connections, draining in-flight submissions")
    await server.stop()
    if server.unfit:
        raise ConfigError(server.unfit)
