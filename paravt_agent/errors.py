"""Typed errors a user can cause; each message says what is wrong and what to do next (a settings file's
validation errors too: one line per mistake, below)."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError


class ParaVTError(Exception):
    """Base class of every error ParaVT raises on purpose."""


class VideoError(ParaVTError):
    """A video cannot be opened or the requested frames cannot be decoded."""


class ToolError(ParaVTError):
    """A tool call is invalid (unknown tool, bad arguments, window outside the video)."""


class PolicyError(ParaVTError):
    """The model behind the agent failed (endpoint unreachable, bad response, model missing).

    ``transient`` errors (connection refused, 5xx, 429) are retried by the graph's retry policy.
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class PromptTooLong(PolicyError):
    """A question, an option or the whole prompt is over its token limit (refused before any model call)."""


class ConfigError(ParaVTError):
    """A configuration file or option is invalid."""


class FeedbackError(ParaVTError):
    """Feedback that cannot be trained on (an answer that is not one of the options, empty, too long, a span for a
    multiple-choice question, a second answer that conflicts with the first): refused with what to send instead."""


class StoreError(ParaVTError):
    """The trajectory store could not be reached (a database that went away). ``retryable`` says whether the same
    call may simply be made again: reads and idempotent writes may; the message says what to check otherwise."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


# ------------------------------------------------------------------ validation errors, said for people
# A settings model's validation errors: one line per mistake, naming the key, the closest valid key ("did you mean
# `max_turns`?"), the allowed values, and where the value came from (``--set`` or the file), never pydantic's raw
# text (its error codes and links). Used by every loader of settings (load_yaml_model, apply_overrides): the
# agent's, the trainers', the toy's and the online learner's configs alike.


def _model_of(annotation) -> type[BaseModel] | None:
    """The settings model an annotation holds (``X``, ``X | None``, ``list[X]``), or None."""
    from pydantic import BaseModel  # here: the errors themselves need no pydantic
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def _section(cls: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The settings model at ``path`` (keys and list indices) under ``cls``, or None where it is not one."""
    here: type[BaseModel] | None = cls
    for key in path:
        if isinstance(key, int):
            continue
        if here is None or key not in here.model_fields:
            return None
        here = _model_of(here.model_fields[key].annotation)
    return here


def _dotted(loc: tuple) -> str:
    return ".".join(str(k) for k in loc if not isinstance(k, int) and not str(k).startswith("function-"))


def _source(key: str, message: str, overrides: dict[str, str], source: str | None) -> str | None:
    """Where the value of ``key`` came from: the ``--set`` item that set it (or a section above or below it), else
    the file."""
    for given, item in overrides.items():
        if key and (key == given or key.startswith(given + ".") or given.startswith(key + ".")):
            return f"from --set {item}"
        if not key and f"`{given}`" in message or (not key and given in message.split()):
            return f"from --set {item}"
    return f"in {source}" if source else None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _line(cls: type[BaseModel], err: dict, prefix: str) -> tuple[str, str]:
    """``(dotted key, what is wrong with it)`` of one pydantic error."""
    loc = tuple(err.get("loc") or ())
    key = prefix + _dotted(loc)
    kind, msg = err.get("type", ""), str(err.get("msg", "")).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        parent = _section(cls, loc[:-1])
        known = sorted(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        where = ".".join(k for k in (prefix.rstrip("."), _dotted(loc[:-1])) if k)
        if close:
            hint = f"did you mean `{(where + '.') if where else ''}{close[0]}`?"
        elif len(known) <= 12:
            hint = "the keys here: " + ", ".join(known)
        else:
            hint = "docs/config.md lists every key"
        return key, f"`{key}` is not a setting{' of ' + where if where else ''}; {hint}"
    if kind in ("literal_error", "enum"):
        expected = (err.get("ctx") or {}).get("expected", "")
        return key, f"`{key}`: {_short(err.get('input'))} is not allowed; choose one of {expected}"
    if kind == "missing":
        return key, f"`{key}` is required and not given"
    if not loc:
        return "", msg
    return key, f"`{key}`: {msg[:1].lower() + msg[1:]} (got {_short(err.get('input'))})"


def explain_lines(exc: ValidationError, cls: type[BaseModel], overrides: list[str] | None = None,
                  source: str | Path | None = None, prefix: str = "") -> list[str]:
    """One line per error of ``exc`` (validating ``cls``): the key, what is wrong, and where it came from (``--set
    KEY=VALUE`` among ``overrides``, else ``source``, the file). ``prefix`` is the dotted section ``cls`` sits under
    (``agent.`` for a GRPO run's agent settings)."""
    given = {item.split("=", 1)[0].strip(): item for item in overrides or [] if "=" in item}
    out = []
    for err in exc.errors():
        key, what = _line(cls, err, prefix)
        came = _source(key, what, given, str(source) if source else None)
        line = f"{what} ({came})" if came else what
        if line not in out:
            out.append(line)
    return out


def explain_validation(exc: ValidationError, cls: type[BaseModel], overrides: list[str] | None = None,
                       source: str | Path | None = None) -> str:
    """The message of a :class:`~paravt_agent.errors.ConfigError`: a head naming the settings and their file, then
    :func:`explain_lines`, one per line."""
    head = f"invalid {cls.__name__}" + (f" ({source})" if source else "")
    return head + ":\n" + "\n".join(f"  {line}" for line in explain_lines(exc, cls, overrides, source))
