"""LoRA for PARA-GRPO and online learning (``GRPOConfig.lora``): the trainer trains adapters (peft) on the frozen
policy, and a version is its adapter — megabytes, not a model.

- :func:`wrap` adapts the loaded model (the vision tower is left out by default, as in SFT);
- :func:`adapter_state` gathers the adapter's tensors (from the shards under FSDP2; a collective);
- :func:`save_adapter` writes a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
  what SGLang's ``/load_lora_adapter`` and peft load;
- :func:`export_merged` writes a plain model directory with the adapter merged into a fresh copy of the base (the
  trained model keeps its adapter), for a server or an evaluation that takes whole models.

The reference policy of the KL term is the base itself (the adapter disabled): no second copy is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from paravt_train.infra.distributed import barrier, rank_world

__all__ = ["adapter_state", "export_merged", "is_lora", "save_adapter", "wrap"]


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def _config(settings):
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none")


def wrap(model, settings):
    """The model with LoRA adapters on ``settings.target_modules``; only the adapters train."""
    from peft import get_peft_model

    return get_peft_model(model, _config(settings))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors by peft's names (``...lora_A.weight``), on the CPU; every rank calls it under FSDP2
    (the full tensors are gathered), rank 0 gets them."""
    from peft import get_peft_model_state_dict

    _, world = rank_world()
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return get_peft_model_state_dict(model, state_dict=full)
    return {k: v.detach().to("cpu").clone() for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model, path: str | Path, settings, base: str) -> Path:
    """A peft adapter directory at ``path`` (every rank calls it; rank 0 writes, atomically)."""
    from safetensors.torch import save_file

    path = Path(path)
    state = adapter_state(model)
    rank, _ = rank_world()
    if rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        cfg = _config(settings).to_dict()
        cfg.update(base_model_name_or_path=str(base), peft_type="LORA", task_type=None)
        (tmp / "adapter_config.json").write_text(json.dumps(_jsonable(cfg), indent=1))
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    barrier()
    return path


def export_merged(model, processor, base: str, path: str | Path, settings, agent_config_yaml: str | None) -> Path:
    """A plain model directory: a fresh copy of ``base`` with the trained adapter merged in (every rank calls it:
    gathering the adapter is a collective; rank 0 writes, atomically)."""
    import shutil

    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForImageTextToText

    # beside the heavy imports above: this module is imported by configs that never export a merged model
    from paravt_agent.config import AGENT_CONFIG_FILE

    state = adapter_state(model)
    rank, _ = rank_world()
    path = Path(path)
    if rank == 0:
        fresh = get_peft_model(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32),
                               _config(settings))
        set_peft_model_state_dict(fresh, state)
        merged = fresh.merge_and_unload()
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if agent_config_yaml is not None:
            (tmp / AGENT_CONFIG_FILE).write_text(agent_config_yaml)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    barrier()
    return path


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return str(obj)
