"""`smtpguard console -c FILE`: the console alone against the config's store, until SIGTERM
or SIGINT. SIGHUP re-reads FILE as `serve` does for its console: operators, hashes, roles,
session_ttl, hosts and trusted_proxies apply (sessions of a changed or removed operator
end), a file that does not validate is refused and logged, and a file without a console
section stops the console. A changed store is named as needing a restart."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from smtpguard.config import Config, ConfigError, load, read_secret
from smtpguard.console.app import Console
from smtpguard.store import store_from_url

log = logging.getLogger("smtpguard.console")


async def run(config: Config, path: Path | str) -> None:
    assert config.console is not None
    password = read_secret(config.store.password_env, config.store.password_file, "store")
    store = store_from_url(config.store.url, password=password, create=False)
    await store.open()
    running = config
    console = Console(lambda: running, store, config.console)
    stop = asyncio.Event()

    def reload() -> None:
        nonlocal running
        try:
            new = load(path)
        except ConfigError as e:
            log.error("reload refused; keeping the running config", extra={"problems": e.problems})
            return
        if new.console is None:
            log.warning("console stopped: the config has no console section")
            stop.set()
            return
        if new.store != config.store:
            # The store was opened at start; the console goes on reading that one.
            log.warning("store changes take effect only after a restart")
        running = new
        for what in console.reload(new.console):
            log.warning(f"{what} changes take effect only after a restart")
        log.info("config reloaded")

    try:
        await console.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload)
        print(f"console on {config.console.address} (port {console.port})", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await console.stop()
        await store.close()
