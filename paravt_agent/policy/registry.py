"""Policy backends by name, as pluggable as tools.

Built-ins: ``local`` (an in-process transformers model), ``openai`` (any
OpenAI-compatible endpoint), ``sglang`` (SGLang's native token-in/token-out API).
Third-party backends register through the ``paravt.policies`` entry-point group;
an entry point names a factory ``(model, endpoint, api_key, **options) -> Policy``
(a :class:`~paravt_agent.policy.base.Policy` subclass with that constructor works)::

    [project.entry-points."paravt.policies"]
    my_backend = "my_pkg.policy:MyPolicy"

``make_policy("my_backend", model=..., endpoint=...)`` and ``Agent(backend="my_backend")``
then find it, as do the CLIs' ``--backend`` options.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from paravt_agent.errors import ConfigError
from paravt_agent.plugins import load_entry_points
from paravt_agent.policy.base import Policy

__all__ = ["ENTRY_POINT_GROUP", "available_policies", "make_policy", "make_rollout_policy", "register_policy"]

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "paravt.policies"

Factory = Callable[..., Policy]


def _local(model=None, endpoint=None, api_key=None, model_obj=None, processor=None, max_batch: int = 8,
           autocast=None, **kw) -> Policy:
    # lazy: a backend and its client library load when it is used
    from paravt_agent.policy.local import LocalPolicy

    if not model:
        raise ConfigError("the local backend needs model=<path of a model directory>")
    return LocalPolicy(model, model_obj=model_obj, processor=processor, max_batch=max_batch, autocast=autocast, **kw)


def _openai(model=None, endpoint=None, api_key=None, **kw) -> Policy:
    # lazy: a backend and its client library load when it is used
    from paravt_agent.policy.openai_backend import OpenAIPolicy

    return OpenAIPolicy(model=model, endpoint=endpoint, api_key=api_key, **kw)


def _sglang(model=None, endpoint=None, api_key=None, processor=None, lora=None, **kw) -> Policy:
    # lazy: a backend and its client library load when it is used
    from paravt_agent.policy.sglang_backend import SGLangPolicy

    if not model:
        raise ConfigError("the sglang backend needs model=<path or name of the served model's processor>")
    return SGLangPolicy(model=model, endpoint=endpoint, processor=processor, lora=lora, api_key=api_key, **kw)


_REGISTRY: dict[str, Factory] = {"local": _local, "openai": _openai, "sglang": _sglang}


def register_policy(name: str, factory: Factory) -> None:
    """Make ``factory`` available as backend ``name`` (replaces an earlier one of that name)."""
    _REGISTRY[name] = factory


def _load_entry_points() -> None:
    load_entry_points(ENTRY_POINT_GROUP, _REGISTRY, "policy")


def available_policies() -> list[str]:
    _load_entry_points()
    return list(_REGISTRY)


def make_policy(backend: str, model: str | None = None, endpoint: str | None = None, api_key: str | None = None,
                **options) -> Policy:
    """A policy by backend name: ``local`` (a model directory), ``openai`` or ``sglang`` (an endpoint), or a
    registered plugin."""
    _load_entry_points()
    factory = _REGISTRY.get(backend)
    if factory is None:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(_REGISTRY)}")
    policy = factory(model=model, endpoint=endpoint, api_key=api_key, **options)
    if not isinstance(policy, Policy):
        raise ConfigError(f"backend {backend!r} returned {type(policy).__name__}, not a paravt Policy")
    return policy


def make_rollout_policy(backend: str, model: str, endpoint: str | None = None, *, trained_model=None,
                        processor=None, max_batch: int | None = None, lora: str | None = None,
                        api_key: str | None = None, autocast=None) -> Policy:
    """The policy RL rolls out with, by backend name: any registered backend that returns token ids and
    logprobs (``local``, ``sglang``, a plugin). A factory is offered, by the names it declares, the trained
    model itself (``model_obj``: an in-process backend then generates with the trained parameters and
    nothing needs syncing), the trainer's ``processor``, the ``max_batch`` of concurrent calls it may
    batch, ``lora``: the name of the LoRA adapter the server holds the trained weights under (a LoRA run's
    ``sync.via: lora``), which a server backend names in every request, ``api_key``: the server's key, and
    ``autocast``: the trainer's autocast dtype, which an in-process backend generating with the trained model
    generates under (the rollouts then come from the numerics the update scores them with)."""
    import inspect

    _load_entry_points()
    factory = _REGISTRY.get(backend)
    if factory is None:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(_REGISTRY)}")
    offered = {"model_obj": trained_model, "processor": processor, "max_batch": max_batch, "lora": lora,
               "api_key": api_key, "autocast": autocast}
    declared = inspect.signature(factory).parameters
    policy = factory(model=model, endpoint=endpoint, **{k: v for k, v in offered.items()
                                                         if v is not None and k in declared})
    if not isinstance(policy, Policy):
        raise ConfigError(f"backend {backend!r} returned {type(policy).__name__}, not a paravt Policy")
    if not policy.returns_tokens:
        raise ConfigError(f"backend {backend!r} returns no token ids and logprobs, which RL trains on; use "
                          "local or sglang (or a backend that returns them)")
    return policy
