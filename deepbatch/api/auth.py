"""API keys bound to tenants: the ``--api-keys-file`` format and the table the auth gate reads.

One key per line, its tenant, then optional settings::

    # key              tenant   settings
    sk-acme-1          acme     priority_ceiling=0  max_concurrent=8
    sk-batch-7         batch    priority_ceiling=10

``#`` at the start of a line or after whitespace starts a comment; blank lines are skipped.
Settings:

- ``priority_ceiling=N``: the most urgent priority the key may ask for. Lower values run first,
  so the ceiling is the smallest ``priority`` its requests may carry;
- ``max_concurrent=N``: requests of this key in flight at once (N >= 1); more get 429.

The table never holds a key, only its keyed digest, so nothing that prints the table or an
entry can leak one; error messages name the file and line, never the key.
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Keys are looked up by HMAC-SHA256 under a per-process random key, not compared one by one.
# The dict lookup's timing depends only on the digest, which an attacker can neither predict nor
# relate to the secret without this process key, so the lookup is constant-time with respect to
# the secret; it costs the same with ten keys or ten thousand (hmac.compare_digest over every
# entry grows with the table), and the table keeps no key in memory. A fresh key per process is
# enough: digests are never stored or sent anywhere, and reloads within a process share it, so
# a key keeps its identity (and its in-flight count) across a reload.
_DIGEST_KEY = secrets.token_bytes(32)

_COMMENT = re.compile(r"(?:^|\s)#.*$")
_PRINTABLE_ASCII = re.compile(rb"[\x21-\x7e]+")


class KeyFileError(ValueError):
    """A malformed keys file; the message names the file and line."""


def key_digest(key: bytes) -> bytes:
    return hmac.digest(_DIGEST_KEY, key, "sha256")


@dataclass(frozen=True)
class KeyEntry:
    # None (the plain --api-key): no tenant is bound, so the request's ``user`` field names it,
    # "default" without one, as on a server with no keys file.
    tenant: str | None
    max_priority: int | None = None  # the priority ceiling; None: any priority
    max_concurrent: int | None = None  # None: no per-key limit
    source: str = "--api-key"  # where it was defined ("PATH:LINE"), for logs


@dataclass(frozen=True)
class KeyTable:
    """Key digest -> entry. ``lookup`` is the only way in, and it takes the presented secret."""

    entries: Mapping[bytes, KeyEntry] = field(default_factory=lambda: MappingProxyType({}))

    def lookup(self, presented: bytes) -> tuple[bytes, KeyEntry] | None:
        """``(digest, entry)`` for a known key, else None; the digest identifies the key across
        reloads without holding it."""
        digest = key_digest(presented)
        entry = self.entries.get(digest)
        return None if entry is None else (digest, entry)

    def __len__(self) -> int:
        return len(self.entries)


_SETTINGS = {"priority_ceiling": "max_priority", "max_concurrent": "max_concurrent"}


def _parse_settings(where: str, fields: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in fields:
        name, sep, value = f.partition("=")
        if not sep or name not in _SETTINGS:
            raise KeyFileError(f"{where}: unknown setting {f[:64]!r}; expected "
                               + " or ".join(f"{n}=N" for n in _SETTINGS))
        if _SETTINGS[name] in out:
            raise KeyFileError(f"{where}: {name} is given twice")
        try:
            number = int(value)
        except ValueError:
            raise KeyFileError(f"{where}: {name} must be an integer, got {value[:32]!r}") from None
        if name == "max_concurrent" and number < 1:
            raise KeyFileError(f"{where}: max_concurrent must be at least 1, got {number}")
        out[_SETTINGS[name]] = number
    return out


def parse_key_file(text: str, path: str, api_key: str | None = None) -> KeyTable:
    """The table of ``text`` (the contents of ``path``), plus ``api_key`` (no tenant bound) when
    given. Raises KeyFileError naming the line for a malformed line, a key given twice, or a key
    that is also the ``--api-key``."""
    by_digest: dict[bytes, KeyEntry] = {}
    lines: dict[bytes, int] = {}
    extra = key_digest(api_key.encode()) if api_key else None
    for number, raw in enumerate(text.splitlines(), start=1):
        where = f"{path}:{number}"
        fields = _COMMENT.sub("", raw).split()
        if not fields:
            continue
        if len(fields) < 2 or "=" in fields[1]:
            raise KeyFileError(f"{where}: expected 'KEY TENANT [priority_ceiling=N] [max_concurrent=N]'")
        key = fields[0].encode("utf-8", "replace")
        if _PRINTABLE_ASCII.fullmatch(key) is None:
            raise KeyFileError(f"{where}: the key must be printable ASCII (it travels in an HTTP header)")
        digest = key_digest(key)
        if digest in lines:
            raise KeyFileError(f"{where}: the same key as line {lines[digest]}; each key names one tenant")
        if digest == extra:
            raise KeyFileError(f"{where}: this key is also the --api-key; keep it in one place")
        lines[digest] = number
        by_digest[digest] = KeyEntry(fields[1], source=where, **_parse_settings(where, fields[2:]))
    if extra is not None:
        by_digest[extra] = KeyEntry(None)
    return KeyTable(MappingProxyType(by_digest))


def load_keys(path: str | None, api_key: str | None = None) -> KeyTable | None:
    """The server's key table: the keys file (if any) plus ``api_key``; None when neither is set
    (no authentication)."""
    if path is None:
        return parse_key_file("", "--api-key", api_key) if api_key else None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read the API keys file {path}: {e}") from None
    return parse_key_file(text, path, api_key)
