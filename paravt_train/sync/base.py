"""The one interface every weight sync implements, two verbs: ``push(model, version)``, called by every training rank
after an update (the sync gathers what it needs from the (possibly sharded) model and rank 0 talks to the servers),
and ``serve(path, version)``, which puts a saved model directory or adapter (a kept version, a rollback, a gate's
candidate) on the servers; and what a rollout asks of it, :attr:`WeightSync.adapter_name`."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from pathlib import Path

from paravt_agent._moved import REMOVED_IN

__all__ = ["WeightSync", "renamed", "renamed_attribute"]


def renamed(old: str, new: str) -> None:
    """The warning of a deprecated name that still works until :data:`~paravt_agent._moved.REMOVED_IN`."""
    warnings.warn(f"{old} is {new} now; the old name goes away in {REMOVED_IN}", DeprecationWarning, stacklevel=3)


def renamed_attribute(old: str, new: str, attr: str) -> property:
    """A deprecated attribute ``old`` that reads and writes ``attr``, warning that it is ``new`` now."""

    def get(self):
        renamed(old, new)
        return getattr(self, attr)

    def put(self, value) -> None:
        renamed(old, new)
        setattr(self, attr, value)

    return property(get, put, doc=f"Deprecated: {new}.")


class WeightSync(ABC):
    """Puts weights on the rollout servers. Every rank calls :meth:`push` (gathering a sharded model is a
    collective); rank 0 returns the servers' answer, the other ranks None. A failure is raised on the rank it
    happened on; the trainer makes every rank raise it after a barrier. :meth:`serve` is called on one process (rank
    0, or a command) with a directory the servers can read."""

    #: the servers' base URLs (a router's workers are found at each push)
    urls: list[str]

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def adapter_name(self) -> str | None:
        """The name the servers hold the trained weights under, which every rollout request names (SGLang's
        ``lora_path``); None when they are the served model's own weights (a full-weight sync)."""
        return None

    @abstractmethod
    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Make the servers serve ``model``'s weights as ``weight_version`` ``version``."""

    @abstractmethod
    def serve(self, path: str | Path, version: str | None = None) -> dict:
        """Make the servers serve the weights saved in ``path`` (what this sync's :meth:`push` would have put there:
        a model directory, or a LoRA run's adapter directory), as ``weight_version`` ``version`` where the servers
        name one."""
