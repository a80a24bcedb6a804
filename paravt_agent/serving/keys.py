"""Who is calling ``paravt api``: the principal an API key belongs to (:mod:`paravt_agent.store.principals`).

The operator maps keys to principals in a keys file (``paravt api --keys FILE``), YAML, a principal's name to its
key or keys::

    alice: pvt-3kQ...                # the key itself
    team-b:                          # several keys, one principal (one voter)
      - pvt-Zr8...
      - sha256:9f86d081884c7d65...   # or the key's SHA-256, so the file holds no secret

or in the trajectory store (``--keys store``; ``paravt keys add NAME`` makes a key, ``paravt keys revoke NAME``
deletes them). The file is read again when it changes, so deleting a stolen key's line revokes it at the next
request (the last line too: an emptied file admits no key); a file that becomes unreadable or malformed while the
server runs admits no key until it is fixed (it fails closed, and says so). A key in the store is looked up again
after :data:`STORE_TTL` seconds; an unknown token is asked of the store every time, never remembered.

A request's bearer token is then the principal ``key:NAME`` it was mapped to, or the server's one ``--api-key``
(``api:DIGEST``: everyone holding it is one principal), or refused (401). With no key configured at all, every
caller is one principal, ``api:anonymous``, whatever token it sends.
"""

from __future__ import annotations

import hmac
import os
import re
import threading
import time
from pathlib import Path

from paravt_agent.errors import ConfigError
from paravt_agent.store.principals import ANONYMOUS, check_principal, key_digest, key_principal

__all__ = ["STORE_TTL", "KeyRing", "read_keys_file"]

STORE_TTL = 5.0  # seconds a key looked up in the store is remembered (a revoked one stops working after this)
STORE_CACHE = 1024  # keys the store's answers are remembered for at most (the oldest forgotten first)


def read_keys_file(path: str | Path, allow_empty: bool = False) -> dict[str, str]:
    """``{SHA-256 of a key: principal}`` from a keys file (see the module); a ConfigError says what is wrong, never
    quoting the file (its lines hold keys). ``allow_empty``: an empty file is no keys (else refused)."""
    import yaml  # only a server started with a keys file reads one

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--keys {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"--keys {path}: not valid YAML{where}") from None
    if allow_empty and not data:
        return {}
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"--keys {path}: expected a mapping of principal names to keys, e.g. `alice: pvt-...`")
    out: dict[str, str] = {}
    for name, keys in data.items():
        try:
            principal = key_principal(str(name))
        except ValueError as exc:
            raise ConfigError(f"--keys {path}: {exc}") from None
        for key in keys if isinstance(keys, list) else [keys]:
            if not isinstance(key, str) or len(key.strip()) < 8:
                raise ConfigError(f"--keys {path}: {name}'s key must be a string of at least 8 characters")
            key = key.strip()
            digest = key[7:].lower() if key.startswith("sha256:") else key_digest(key)
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ConfigError(f"--keys {path}: {name}'s sha256: must be followed by 64 hex digits")
            if digest in out and out[digest] != principal:
                raise ConfigError(f"--keys {path}: one key is given to both {out[digest]} and {principal}")
            out[digest] = principal
    return out


class KeyRing:
    """The principal of a bearer token: the keys file's, the store's, the one ``api_key``'s, or anonymous when
    nothing is configured (:meth:`principal`; None: refused)."""

    def __init__(self, api_key: str | None = None, keys: str | None = None, store=None):
        if keys == "store" and store is None:
            raise ConfigError("--keys store needs --store (the trajectory store that holds the keys)")
        self.api_key, self.source = api_key, keys
        self.store = store if keys == "store" else None
        self.path = Path(keys) if keys not in (None, "store") else None
        self._lock = threading.Lock()
        self._file: dict[str, str] = {}
        self._stamp: tuple | None = None
        self._cache: dict[str, tuple[float, str | None]] = {}
        if self.path is not None:
            self._reload()

    @property
    def required(self) -> bool:
        """A key is needed (401 without one)."""
        return bool(self.api_key or self.source)

    @property
    def maps_principals(self) -> bool:
        """Keys are mapped to principals (else every caller is one principal)."""
        return self.source is not None

    def principal(self, token: str) -> str | None:
        """The principal ``token`` authenticates as; None: it is refused."""
        if not self.required:
            return ANONYMOUS
        if not token:
            return None
        if self.api_key and hmac.compare_digest(token.encode(), self.api_key.encode()):
            return "api:" + key_digest(token)[:12]
        digest = key_digest(token)
        if self.path is not None:
            self._reload()
            return self._file.get(digest)
        if self.store is not None:
            return self._stored(digest)
        return None

    def _reload(self) -> None:
        """Read the keys file again when it changed (its stat, on every request). After start, a file that became
        unreadable or malformed admits no key until it is fixed (fails closed: a deleted line must never stay in
        force), and says so each time it is read."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stamp is None:
                raise ConfigError(f"--keys {self.path}: {exc.strerror}") from None
            if self._file:
                print(f"warning: --keys {self.path}: {exc.strerror}; no key is admitted until it is back", flush=True)
            self._file, self._stamp = {}, ("gone",)
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                self._file = read_keys_file(self.path, allow_empty=self._stamp is not None)
            except ConfigError as exc:
                if self._stamp is None:
                    raise
                self._file = {}
                print(f"warning: {exc}; no key is admitted until it is fixed", flush=True)
            self._stamp = stamp

    def _stored(self, digest: str) -> str | None:
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < STORE_TTL:
            return hit[1]
        name = self.store.principal_of_key(digest)
        if not name:
            return None  # never remembered: random tokens must not grow the cache
        principal = key_principal(check_principal(name))
        with self._lock:
            while len(self._cache) >= STORE_CACHE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[digest] = (now, principal)
        return principal

    def describe(self) -> str:
        """Who the callers are on a server without mapped keys (its start-up warning)."""
        if self.source is not None:
            return f"the principals --keys {self.source} maps"
        if self.api_key:
            return "one principal: everyone holding --api-key (api:" + key_digest(self.api_key)[:12] + ")"
        return f"one principal: every caller ({ANONYMOUS})"
