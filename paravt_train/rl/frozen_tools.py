"""Frozen tools are frozen models: what the model-backed tools ask under ``tool_model_calls: freeze``.

Weaver's tools (weaver.txt, Table 1) and VideoChat-M1's (expert models in its supplement) are models that RL never
updates. ``freeze`` keeps the tools' calls out of the loss; that alone would leave them asking the LIVE policy, whose
weights change every step, so a tool's answer to the same question would drift with training — a tool that learns
through the back door. The trainer therefore gives the agent a tool model serving the STARTING weights
(:func:`frozen_tool_policy`), chosen by what it costs:

* the policy generates in this process (``local``): a frozen in-process copy the optimizer never sees. The KL
  reference is one already (the starting weights, ``requires_grad`` off, bf16 on GPUs) and is reused at no cost;
  without one (``kl_coef: 0``, or LoRA, whose reference is the adapter switched off) a copy is loaded once.
* the policy is served (``sglang``) and the run trains LoRA adapters (``sync.via: lora``): the server's base
  model IS the starting weights; the tools ask the same server without naming the adapter (no second engine).
* served, full fine-tuning: every push overwrites the served weights, so the starting weights need a second
  server. A second SGLang engine costs a share of a GPU but generates fast; a frozen copy here would put a whole
  model on the trainer's device and generate with transformers, many times slower than the engine on the calls a
  Weaver episode makes most (a grounding call per crop). So the run asks for the second server: name it in the
  agent config's ``tool_models`` (every model-backed tool), or train the tools' calls (``tool_model_calls: train``).

A tool named in ``tool_models`` asks that model in every case.
"""

from __future__ import annotations

from paravt_agent.errors import ConfigError
from paravt_agent.policy.registry import make_rollout_policy

__all__ = ["frozen_tool_policy", "unnamed_model_tools"]


def unnamed_model_tools(agent) -> list[str]:
    """The agent's model-backed tools (``uses_model``) that its config names no model for (``tool_models``): the
    ones that would ask the agent's policy."""
    return [t.name for t in agent.registry if getattr(t, "uses_model", False)
            and t.name not in agent.config.tool_models]


def frozen_tool_policy(trainer, agent):
    """The model ``agent``'s model-backed tools ask in a run of ``trainer`` (set up up to its agent): None when they
    ask the live policy (``tool_model_calls: train``) or none needs one; else the starting weights (the module
    docstring says where from). Raises :class:`ConfigError` for a served full fine-tuning run without a second
    server named."""
    cfg = trainer.cfg
    tools = unnamed_model_tools(agent)
    if cfg.tool_model_calls != "freeze" or not tools:
        return None
    policy = agent.policy
    if policy.generates_with(trainer.model):  # in process: a frozen copy the optimizer never updates
        frozen = trainer.ref if trainer.ref is not None and trainer.world == 1 else None
        if frozen is None:
            import torch  # lazy, as the trainer's own model loading
            from transformers import AutoModelForImageTextToText

            dtype = trainer.autocast_dtype or torch.float32
            frozen = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=dtype)
            frozen = frozen.to(trainer.device).eval().requires_grad_(False)
        return make_rollout_policy("local", cfg.model, trained_model=frozen, processor=trainer.processor,
                                   max_batch=cfg.rollout_batch, autocast=trainer.autocast_dtype)
    adapter = getattr(trainer.syncer, "adapter_name", None) if trainer.syncer is not None else None
    if cfg.lora.enabled and adapter:  # the server's base model is the starting weights: ask it without the adapter
        return make_rollout_policy(cfg.backend, cfg.model, cfg.endpoint, max_batch=cfg.rollout_batch,
                                   api_key=cfg.sync.api_key())
    raise ConfigError(
        f"tool_model_calls: freeze on a served policy whose weights this run updates: the tools {', '.join(tools)} "
        f"would ask the live policy. Serve the starting weights ({cfg.model}) on a second server and name it for them "
        "in the agent config's tool_models (e.g. agent: {tool_models: {" + tools[0] + ": {backend: sglang, model: "
        f"{cfg.model}, endpoint: http://127.0.0.1:30001}}}}), or train the tools' calls (tool_model_calls: train)")
