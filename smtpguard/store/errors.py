"""The one place a driver's error becomes StoreUnavailable (451 4.3.0, nothing relayed), and
where one store operation gets its deadline: every network backend wraps its operations in
the translator it builds here, naming its own driver's errors."""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from smtpguard.store.base import REFUSES_WRITES, UNREACHABLE, StoreUnavailable

S = TypeVar("S")
P = ParamSpec("P")
T = TypeVar("T")


class Translator(Protocol):
    """A decorator for a store's async methods (generic in the store's class, so a backend
    split into several classes shares one)."""

    def __call__(
        self, fn: Callable[Concatenate[S, P], Awaitable[T]], /
    ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]: ...


def translated(
    *driver_errors: type[Exception],
    backend: str,
    timeout: Callable[[], float],
    on_error: Callable[[Any, Exception], None] | None = None,
) -> Translator:
    """Each call gets `timeout()` seconds (read at the call); any of `driver_errors` (include
    OSError: it covers TimeoutError, the deadline passing) is raised as StoreUnavailable
    naming the backend and the error, after `on_error(store, error)` if given."""

    def decorate(
        fn: Callable[Concatenate[S, P], Awaitable[T]], /
    ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
        async def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
            try:
                async with asyncio.timeout(timeout()):
                    return await fn(self, *args, **kwargs)
            except driver_errors as e:
                if on_error is not None:
                    on_error(self, e)
                raise StoreUnavailable(f"{backend}: {type(e).__name__}: {e}".strip()) from e

        functools.update_wrapper(wrapper, fn)
        return wrapper

    return decorate


class Probed(ABC):
    """ping and unready (Store) of every backend, over its `_refusal`: one round trip that
    raises StoreUnavailable when the store does not answer and returns why it would refuse
    a write (None: it would take one)."""

    @abstractmethod
    async def _refusal(self) -> str | None: ...

    async def ping(self) -> bool:
        return await self.unready() != UNREACHABLE

    async def unready(self) -> str | None:
        try:
            why = await self._refusal()
        except StoreUnavailable:
            return UNREACHABLE
        return None if why is None else f"{REFUSES_WRITES}: {why}"
