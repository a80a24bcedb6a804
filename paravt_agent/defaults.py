"""Where the embedded default (the toy world's tiny policy) lives."""

from __future__ import annotations

import os
from pathlib import Path

from paravt_agent.errors import PolicyError


def paravt_home() -> Path:
    """``$PARAVT_HOME`` or ``~/.cache/paravt``: built toy data and models."""
    return Path(os.environ.get("PARAVT_HOME") or Path.home() / ".cache" / "paravt")


SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "toy"


def default_model_dir(candidates=None) -> str:
    """The toy policy: built by ``paravt-train toy``, else the one the repository ships; a clear error if neither."""
    for candidate in candidates or (paravt_home() / "toy" / "model", SHIPPED):
        if (Path(candidate) / "config.json").is_file():
            return str(candidate)
    raise PolicyError(
        "no model given and no toy policy found; build it with `paravt-train toy` "
        "or pass --model DIR (or --backend openai --endpoint URL)"
    )
