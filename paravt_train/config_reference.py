"""The reference of every configuration field, generated from the pydantic models (``docs/config.md``).

    python -m paravt_train.config_reference > docs/config.md

Each field is documented once, in its model; this page, the YAML files and the
``--set key=value`` overrides all name the same fields. The page opens with what a
user sets (a model's ``user_settings``, by topic: model, data, method, budget,
output) and each training method's values (:mod:`paravt_train.methods`); the
advanced rest follows, model by model (every model the entry points' configs
hold, found through their fields). A test checks the page is current and that no
field lacks a description.
"""

from __future__ import annotations

import json
import typing
import warnings

from pydantic import BaseModel

from paravt_agent.config import AgentConfig
from paravt_train.methods import METHODS
from paravt_train.online.config import OnlineConfig
from paravt_train.rl.config import GRPOConfig
from paravt_train.sft.config import SFTConfig
from paravt_train.toy.build import ToyConfig

__all__ = ["MODELS", "render", "undocumented"]

#: the configs an entry point loads: (model, what loads it, the heading of its settings under "What you set")
_ROOTS: list[tuple[type[BaseModel], str, str]] = [
    (GRPOConfig, "`paravt-train grpo` and `paravt-train online` (`--config/--set`)",
     "Training: `paravt-train grpo`, `paravt-train online`"),
    (OnlineConfig, "`paravt-train online` (`--config/--set`): a GRPO config and `online:`", ""),
    (AgentConfig, "the agent (`Agent(config=...)`, `paravt answer --config/--set`, a model's `agent_config.yaml`)",
     "The agent: `Agent`, `paravt answer`, a model's `agent_config.yaml`"),
    (SFTConfig, "`paravt-train sft --config/--set`", "SFT: `paravt-train sft`"),
    (ToyConfig, "`paravt-train toy --set`", ""),
]
#: a line of context for some models, after where they are used
_NOTES = {"Layout": "Set by `preset` ([Protocol presets](presets.md)).",
          "GRPOConfig": "`method` sets some of them ([Methods](#methods)).",
          "OnlineConfig": "Its other fields are GRPOConfig's (above)."}


def _own_fields(model: type[BaseModel]) -> dict:
    """A model's fields, without those of a pydantic base it extends (OnlineConfig's own: ``online``)."""
    base = next((b for b in model.__bases__ if isinstance(b, type) and issubclass(b, BaseModel) and b is not BaseModel),
                None)
    return {k: f for k, f in model.model_fields.items() if base is None or k not in base.model_fields}


def _nested(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside a field's type (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested(arg)]


def _models() -> list[tuple[str, type[BaseModel], str]]:
    """``(name, model, where it is used)`` for every root and every model inside one, roots' children after them."""
    used: dict[type[BaseModel], list[str]] = {}
    order: list[type[BaseModel]] = []

    def visit(model: type[BaseModel], where: str) -> None:
        if model in used:
            used[model].append(where)
            return
        used[model] = [where]
        order.append(model)
        for key, f in model.model_fields.items():
            for child in _nested(f.annotation):
                visit(child, f"`{model.__name__}.{key}`")

    for root, where, _ in _ROOTS:
        visit(root, where)
    return [(m.__name__, m, ", ".join(used[m])) for m in order]


MODELS = _models


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return f"`{type(value).__name__}()`"
    return _value(value)


def _value(value) -> str:
    # a list of settings objects (e.g. ToyConfig.then) as the YAML/JSON a user would write
    text = json.dumps(value, default=lambda v: v.model_dump() if isinstance(v, BaseModel) else str(v),
                      ensure_ascii=False)
    return f"`{text}`"


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    text = text or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace("|", "\\|")


def _row(key: str, f, *lead: str) -> str:
    desc = (f.description or "").replace("\n", " ").replace("|", "\\|")
    return "| " + " | ".join([*lead, f"`{key}`", _type(f.annotation), _default(f), desc]) + " |"


def undocumented() -> list[str]:
    """``Model.field`` of every field without a description."""
    return [f"{name}.{key}" for name, model, _ in _models() for key, f in model.model_fields.items()
            if not (f.description or "").strip()]


def _user_section(model: type[BaseModel], heading: str) -> list[str]:
    lines = [f"### {heading}", "", f"`{model.__name__}`; the rest of it is under [Advanced](#advanced).", "",
             "| topic | field | type | default | meaning |", "|---|---|---|---|---|"]
    for topic, keys in model.user_settings.items():
        lines += [_row(key, model.model_fields[key], topic) for key in keys]
    return [*lines, ""]


def _flat(data: dict, prefix: str = "") -> list[str]:
    return [k for key, v in data.items()
            for k in (_flat(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]


def _methods_section() -> list[str]:
    names = list(METHODS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        configs = {n: GRPOConfig(model="MODEL", method=n).model_dump(mode="json") for n in names}
    trained = sorted(dict.fromkeys(k for m in METHODS.values() for k in _flat(m.training)), key=lambda k: "." in k)
    agent = list(dict.fromkeys(k for m in METHODS.values() for k in _flat(m.agent)))

    def get(data: dict, dotted: str):
        for k in dotted.split("."):
            data = data[k]
        return data

    lines = ["### Methods", "",
             "`method:` names one (`paravt_train/methods.py`): its agent protocol (unless `agent_config` or "
             "`agent.preset` names another), its agent settings, its training settings (under the fields a config "
             "gives: a field given wins); every method trains with `GRPOTrainer`. Each method's values:", "",
             "| setting | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|",
             "| agent protocol | " + " | ".join(f"`{METHODS[n].protocol}`" if METHODS[n].protocol else
                                               "the model's own" for n in names) + " |"]
    for key in agent:
        lines.append(f"| `agent.{key}` | " + " | ".join(
            _value(get(METHODS[n].agent, key)) if key in _flat(METHODS[n].agent) else "the protocol's"
            for n in names) + " |")
    lines += [f"| `{key}` | " + " | ".join(_value(get(configs[n], key)) for n in names) + " |" for key in trained]
    lines += ["", *(f"- `{n}`: {m.summary}." for n, m in METHODS.items()), ""]
    return lines


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the code by `python -m paravt_train.config_reference` (a test keeps it current).",
             "Every field is set in YAML (`--config`) or with `--set key=value` (dotted keys for nested models, "
             "e.g. `--set reward.gamma=0`); defaults are the paper's values where it gives one.", "",
             "A run needs the settings under **What you set**; every other one has the paper's value or its "
             "method's, and is listed under **Advanced**.", "", "## What you set", ""]
    for model, _, heading in _ROOTS:
        if heading:
            lines += _user_section(model, heading)
        if model is GRPOConfig:
            lines += _methods_section()
    lines += ["## Advanced", ""]
    for name, model, where in _models():
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        user = {k for keys in getattr(model, "user_settings", {}).values() for k in keys}
        note = " ".join(x for x in (_NOTES.get(name, ""), "The fields a user sets are above." if user else "") if x)
        lines += [f"### {name}", "", f"{doc} Used by {where}.{' ' + note if note else ''}", "",
                  "| field | type | default | meaning |", "|---|---|---|---|"]
        lines += [_row(key, f) for key, f in _own_fields(model).items() if key not in user]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
