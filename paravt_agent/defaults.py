"""Where the embedded default (the toy world's tiny policy) lives."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from paravt_agent.errors import PolicyError


def paravt_home() -> Path:
    """``$PARAVT_HOME`` or ``~/.cache/paravt``: built toy data and models."""
    return Path(os.environ.get("PARAVT_HOME") or Path.home() / ".cache" / "paravt")


SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "toy"


#: where a wheel install puts the shipped toy policy (pyproject.toml's data-files)
INSTALLED = Path(sys.prefix) / "share" / "paravt" / "toy"


def default_model_dir(candidates=None) -> str:
    """The toy policy: built by ``paravt-train toy``, else the one the repository ships (a clone or an editable
    install), else the copy a wheel install put under ``sys.prefix``; a clear error if none."""
    for candidate in candidates or (paravt_home() / "toy" / "model", SHIPPED, INSTALLED):
        if (Path(candidate) / "config.json").is_file():
            return str(candidate)
    raise PolicyError(
        "no model given and no toy policy found; build it with `paravt-train toy` "
        "or pass --model DIR (or --backend openai --endpoint URL)"
    )


def resolve_model(backend: str, model: str | os.PathLike | None) -> str | None:
    """The model an entry point runs: for the ``local`` backend, no model or the name ``toy`` (when no folder
    of that name is here) is the toy policy (:func:`default_model_dir`), whatever the working directory."""
    if backend == "local" and (model is None or (str(model) == "toy" and not Path(model).exists())):
        return default_model_dir()
    return None if model is None else os.fspath(model)
