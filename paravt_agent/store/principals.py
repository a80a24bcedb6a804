"""Who a label counts for: its *principal*, the voter the online learner's quorums, per-voter caps and leave-out
checks count (``paravt-train online``; docs/online_trust.md has the trust model).

A principal is someone the server authenticated, never a name the caller chooses:

- ``key:NAME``: the owner of an API key, as the operator mapped keys to principals (``paravt api --keys FILE``,
  or ``--keys store`` with keys made by ``paravt keys add NAME``). A request's ``user`` field is a sub-label within
  that principal (stored as the row's user), never a voter of its own: one key is one voter, whatever ``user``
  names it sends.
- ``api:DIGEST``: the one ``--api-key`` of a server without mapped keys (everyone who holds it is one voter);
  ``api:anonymous``: every caller of a server with no key at all. ``paravt api`` warns at start when it keeps
  feedback this way.
- ``web``: the web page (``gradio_app.py``); every browser session is one anonymous principal together (a session is
  the row's user). ``online.rollback.web_votes: false`` keeps its labels out of the votes (they still train).
- the operator's own code (``Agent.feedback``, ``TrajectoryStore.feedback``) names its principal
  (``principal=``); without one its ``user`` is taken as one (the operator's code holds the store: it vouches for
  the users it names), and a row with neither is the operator's own label, :data:`OPERATOR` (trusted: never capped,
  never left out).

Rows written before principals were stored (0.5.1 and earlier) have none: :func:`principal_of` reads it off the user
the writer stored, ``api:DIGEST/user`` → :data:`LEGACY_API` (one voter for all of them: a 0.5.1 server without a key
made a digest of whatever token a caller sent, so the digests name no one), ``gradio:SESSION`` → ``web``.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["ANONYMOUS", "LEGACY_API", "OPERATOR", "WEB", "check_principal", "key_digest", "key_principal",
           "principal_of", "voter_of_user"]

OPERATOR = "(operator)"  # rows without a principal or a user: the operator's own labels
WEB = "web"  # the web page's sessions, one anonymous principal
ANONYMOUS = "api:anonymous"  # every caller of a paravt api without a key
LEGACY_API = "api:legacy"  # every row an older paravt api stored without a principal, together
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")


def check_principal(name: str) -> str:
    """A principal name as a keys file or ``paravt keys add`` gives it (letters, digits, ``_.@+-``; ≤ 64)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{name!r} is not a principal name: letters, digits and _.@+- (at most 64, starting with a "
                         "letter or digit)")
    return name


def key_digest(key: str) -> str:
    """The SHA-256 of an API key, in hex: what a keys file (``sha256:...``) and the store keep instead of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_principal(name: str) -> str:
    """The principal of a key the operator mapped to ``name``."""
    return f"key:{check_principal(name)}"


def voter_of_user(user: str | None) -> str:
    """The principal of a row that stored none, from the user its writer stored (see the module)."""
    if not user:
        return OPERATOR
    if user.startswith("api:"):
        return LEGACY_API
    if user.startswith("gradio:"):
        return WEB
    return user


def principal_of(row: dict) -> str:
    """The principal a feedback row's label counts for: the one stored with it, else :func:`voter_of_user`."""
    return row.get("principal") or voter_of_user(row.get("user_id"))
