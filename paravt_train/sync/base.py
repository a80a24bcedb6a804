"""The one interface every weight sync implements: ``push(model, version)``, called by every training rank after
an update; the sync gathers what it needs from the (possibly sharded) model and rank 0 talks to the servers."""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["WeightSync"]


class WeightSync(ABC):
    """Puts the trainer's weights on the rollout servers. Every rank calls :meth:`push` (gathering a sharded model
    is a collective); rank 0 returns the servers' answer, the other ranks None. A failure is raised on the rank
    it happened on; the trainer makes every rank raise it after a barrier."""

    #: the servers' base URLs (a router's workers are found at each push)
    urls: list[str]

    @property
    def url(self) -> str:
        return self.urls[0]

    @abstractmethod
    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Make the servers serve ``model``'s weights as ``weight_version`` ``version``."""
