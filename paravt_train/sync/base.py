"""The one interface every weight sync implements, two verbs: ``push(model, version)``, called by every training rank
after an update (the sync gathers what it needs from the (possibly sharded) model and rank 0 talks to the servers),
and ``serve(path, version)``, which puts a saved model directory or adapter (a kept version, a rollback, a gate's
candidate) on the servers; and what a rollout asks of it, :attr:`WeightSync.adapter_name`."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from pathlib import Path

from paravt_agent.compat import REMOVED_IN

__all__ = ["SYNCS", "WeightSync", "register", "renamed", "renamed_attribute"]

#: the syncs by their ``sync.via`` name, each registered at its class (:func:`register`)
SYNCS: dict[str, type[WeightSync]] = {}


def register(name: str, serves_adapters: bool = False):
    """Class decorator: the sync ``sync.via: NAME`` names (verl's checkpoint-engine registry). ``serves_adapters``:
    it puts a LoRA run's adapter on the servers by name, not the model's own weights."""

    def deco(cls: type[WeightSync]) -> type[WeightSync]:
        cls.via, cls.serves_adapters = name, serves_adapters
        SYNCS[name] = cls
        return cls

    return deco


def renamed(old: str, new: str) -> None:
    """The warning of a deprecated name that still works until :data:`~paravt_agent.compat.REMOVED_IN`."""
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
    #: its ``sync.via`` name and whether it serves adapters (set by :func:`register`)
    via: str = ""
    serves_adapters: bool = False
    #: where each push journals itself with a lease (:mod:`paravt_train.sync.lease`); None: no journal
    journal: Path | None = None

    @classmethod
    def from_settings(cls, settings, url: str, *, folder: Path | None, export, device, vision: bool, keys,
                      journal: Path | None) -> WeightSync:
        """The sync for the servers at ``url`` from a run's ``sync:`` settings (:class:`~paravt_train.sync.config.
        SyncSettings`): ``folder`` and ``export`` where and how :meth:`push` writes (disk, lora), ``device`` where the
        model is, ``vision`` whether the run trains the vision tower, ``keys`` the servers' keys, ``journal`` the
        push journal. Every registered sync defines it."""
        raise TypeError(f"{cls.__name__} is not made from settings (register it and define from_settings)")

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
