"""A store client that speaks the run's key space: hidden key names, sealed values (no torch import).

``SealedStore(store, space)`` wraps any TCPStore-like client (torch's ``TCPStore``, ``HashStore``)
and takes the same calls with *logical* key names (``oobleck.runtime.keys``): each key is stored
under ``space.name(key)`` and each value sealed with ``space.seal`` (see "Trust" in ``keys``).
So the controller and the workers keep writing ``store.get(keys.plan(g))`` and read back exactly
what the run wrote, or nothing:

- ``get`` / ``multi_get`` / ``compare_set`` raise ``ForeignValue`` for a value that does not
  verify (a client without the secret overwrote a key it had listed), after one log line;
- ``read`` / ``read_present`` are the lenient forms for values the reader can do without: a missing,
  foreign or malformed value (``parse`` raising ``ValueError``, ``TypeError`` or ``KeyError``) is
  None, with one log line per key and cause;
- ``add`` (counters) and ``wait`` / ``check`` / ``delete_key`` act on the hidden names; ``raw`` is
  the client itself, for torch objects that need one (a ``PrefixStore`` under
  ``space.name(keys.prefix(g))``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, overload

from oobleck.errors import RunError
from oobleck.runtime.keys import KeySpace

T = TypeVar("T")
# How many distinct dropped values are logged per store client; a flood of foreign writes is then
# one line saying more were dropped, not one line each.
MAX_DROP_LINES = 20


class ForeignValue(RunError):
    """A value at a run key that the run did not write (it does not carry the run's seal)."""


class SealedStore:
    """The run's key space on a store client (see the module docstring)."""

    def __init__(self, store: Any, space: KeySpace) -> None:
        self.raw = store
        self.space = space
        self._dropped: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ pass-through
    @property
    def host(self) -> str:
        return self.raw.host

    @property
    def port(self) -> int:
        return self.raw.port

    @property
    def timeout(self) -> timedelta:
        return self.raw.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.raw.set_timeout(timeout)

    # ------------------------------------------------------------------ keys
    def name(self, key: str) -> str:
        return self.space.name(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(self.space.name(key), self.space.seal(key, value))

    def get(self, key: str) -> bytes:
        """The value the run wrote (waits for the key up to the client's timeout, like the store)."""
        return self._open(key, self.raw.get(self.space.name(key)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self.raw.multi_get([self.space.name(key) for key in keys])
        return [self._open(key, value) for key, value in zip(keys, values)]

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.raw.check([self.space.name(key) for key in keys]))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        names = [self.space.name(key) for key in keys]
        if timeout is None:
            self.raw.wait(names)
        else:
            self.raw.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(self.space.name(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(self.space.name(key), amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``desired`` if the key holds ``expected`` ("": if it does not exist); returns the value
        the key holds afterwards (``ForeignValue`` if that is not the run's)."""
        sealed_expected = self.space.seal(key, expected) if expected else b""
        held = self.raw.compare_set(self.space.name(key), sealed_expected, self.space.seal(key, desired))
        return self._open(key, held)

    # ------------------------------------------------------------------ lenient reads
    @overload
    def read(self, key: str) -> bytes | None: ...
    @overload
    def read(self, key: str, parse: Callable[[bytes], T]) -> T | None: ...
    def read(self, key: str, parse: Callable[[bytes], T] | None = None) -> T | bytes | None:
        """The value at ``key`` (``parse``d), or None when it is missing, foreign or malformed."""
        if not self.raw.check([self.space.name(key)]):
            return None
        return self._parsed(key, self.raw.get(self.space.name(key)), parse)

    def read_present(
        self, keys: Sequence[str], parse: Callable[[bytes], T] | None = None
    ) -> dict[str, T | bytes | None]:
        """``read`` of the keys that exist (one round trip when they all do): key -> the value, or
        None when it is foreign or malformed; a missing key is not in the result."""
        names = [self.space.name(key) for key in keys]
        if not names:
            return {}
        if self.raw.check(names):
            return {key: self._parsed(key, value, parse) for key, value in zip(keys, self.raw.multi_get(names))}
        present = [(key, name) for key, name in zip(keys, names) if self.raw.check([name])]
        return {key: self._parsed(key, self.raw.get(name), parse) for key, name in present}

    def _parsed(self, key: str, stored: bytes, parse: Callable[[bytes], T] | None) -> T | bytes | None:
        value = self.space.unseal(key, stored)
        if value is None:
            self.dropped(key, "it does not carry the run's seal (another client wrote it)")
            return None
        if parse is None:
            return value
        try:
            return parse(value)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as error:
            self.dropped(key, f"it is malformed ({error})")
            return None

    def _open(self, key: str, stored: bytes) -> bytes:
        value = self.space.unseal(key, stored)
        if value is None:
            self.dropped(key, "it does not carry the run's seal (another client wrote it)")
            raise ForeignValue(
                f"the value of store key {key!r} was not written by this run (it does not carry the run's seal)"
            )
        return value

    def dropped(self, key: str, why: str) -> None:
        """Say once that a value of ``key`` was dropped, and why."""
        with self._lock:
            if (key, why) in self._dropped:
                return
            self._dropped.add((key, why))
            count = len(self._dropped)
        if count <= MAX_DROP_LINES:
            print(f"oobleck: dropped the value of store key {key!r}: {why}", file=sys.stderr, flush=True)
        elif count == MAX_DROP_LINES + 1:
            print(
                f"oobleck: dropped values of more store keys; only the first {MAX_DROP_LINES} are named",
                file=sys.stderr,
                flush=True,
            )
