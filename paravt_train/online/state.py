"""Where the online learner is: :class:`OnlineState`, a typed record the learner owns and hands to its promotion, saved
with the weights in every checkpoint (the trainer keeps it as its checkpoint's extra state and never reads it).

Its shape is versioned: :meth:`OnlineState.to_dict` writes ``version`` with the fields, :meth:`OnlineState.from_dict`
reads any earlier shape — the one place a checkpoint written by an older release is upgraded (0.5.1 kept a plain dict
of these keys in the trainer, without a version; 0.5.0's live counts were ``[right, labelled]`` per version; before
version 3 the live counts and the rows' windows were kept per user string, now per principal:
:func:`~paravt_agent.store.principals.voter_of_user` merges them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from paravt_agent.store.principals import OPERATOR, voter_of_user

__all__ = ["OPERATOR", "OnlineState", "live_counts"]


def live_counts(entry) -> dict[str, list]:
    """A version's live counts by user ``{user: [sum, sum of squares, labels]}`` (a checkpoint written before labels
    were counted per user holds ``[right, labelled]``: one user, binary scores)."""
    if entry is None:
        return {}
    if isinstance(entry, list):
        return {"(earlier)": [float(entry[0]), float(entry[0]), int(entry[1])]}
    return entry


@dataclass(kw_only=True)
class OnlineState:
    """The learner's progress through the feedback and its versions (saved and restored with the weights)."""

    #: the shape this release writes (:meth:`to_dict`)
    VERSION: ClassVar[int] = 3
    #: what rank 0 reads from the store and every rank must hold the same (broadcast after each poll)
    POLLED: ClassVar[tuple[str, ...]] = ("cursor", "queue", "skipped", "skipped_by", "users", "answers", "live")

    cursor: int = 0  # the last feedback row read (the store's seq)
    queue: list[dict] = field(default_factory=list)  # prompts waiting for an update (PromptItem fields, user, seq)
    skipped: int = 0
    skipped_by: dict[str, int] = field(default_factory=dict)  # why rows were skipped, counted
    trained: list[str] = field(default_factory=list)  # the prompt ids updates trained on
    pending: list[dict] = field(default_factory=list)  # the rows the candidate being made trained on
    users: dict[str, list[float]] = field(default_factory=dict)  # per principal: the times of its rows in the window
    answers: dict[str, str] = field(default_factory=dict)  # per trace: the first answer labelled
    live: dict[str, dict[str, list]] = field(default_factory=dict)  # version -> principal -> [sum, sum sq, labels]
    looks: dict[str, int] = field(default_factory=dict)  # version -> rollback looks used up
    untestable: list[str] = field(default_factory=list)  # versions said to be untestable (once each)
    gated: int = 0  # candidates gated (the pinned set's round)
    since_promotion: int = 0  # updates since the last candidate
    serving: str | None = None  # the version the learner's weights are

    def to_dict(self) -> dict:
        return {"version": self.VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict | None) -> OnlineState:
        """The state a checkpoint holds, in any shape a release wrote (none: a fresh start)."""
        data = dict(data or {})
        version = data.pop("version", 1)
        if version > cls.VERSION:
            raise ValueError(f"the checkpoint's online state is version {version}; this release reads up to "
                             f"{cls.VERSION}: upgrade paravt")
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        known["live"] = {vid: live_counts(entry) for vid, entry in (known.get("live") or {}).items()}
        if version < 3:  # kept per user string: merged per principal (labels past a principal's cap stay counted)
            known["live"] = {vid: _by_principal(c) for vid, c in known["live"].items()}
            users: dict[str, list] = {}
            for user, times in (known.get("users") or {}).items():
                users.setdefault(voter_of_user(user), []).extend(times)
            known["users"] = {who: sorted(t) for who, t in users.items()}
            known["queue"] = [{**d, "user": voter_of_user(d["user"]) if d.get("user") else d.get("user")}
                              for d in known.get("queue") or []]  # max_user_share counts principals here too
        return cls(**known)

    def polled(self) -> dict:
        """What :attr:`POLLED` names, to broadcast from rank 0."""
        return {k: getattr(self, k) for k in self.POLLED}

    def take_polled(self, values: dict) -> None:
        for k in self.POLLED:
            setattr(self, k, values[k])


def _by_principal(counts: dict[str, list]) -> dict[str, list]:
    out: dict[str, list] = {}
    for user, (a, b, n) in counts.items():
        who = out.setdefault(OPERATOR if user == OPERATOR else voter_of_user(user), [0.0, 0.0, 0])
        who[0], who[1], who[2] = who[0] + a, who[1] + b, who[2] + n
    return out
