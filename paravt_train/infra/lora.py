"""LoRA in one place: the settings (``lora:`` of the SFT and GRPO configs), wrapping a model, and the adapter's
exports. A LoRA run trains adapters (peft) on the frozen policy, and an online version is its adapter — megabytes,
not a model.

- :class:`LoraSettings`: rank, scaling, dropout, the adapted modules (the vision tower left out by default);
- :func:`wrap` adapts a loaded model with them; :func:`lora_config` is peft's ``LoraConfig`` of the settings;
- :func:`adapter_state` gathers the adapter's tensors (from the shards under FSDP2; a collective);
- :func:`save_adapter` writes a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
  what SGLang's ``/load_lora_adapter`` and peft load;
- :func:`export_merged` writes a plain model directory with the adapter merged into a fresh copy of the base (the
  trained model keeps its adapter), for a server or an evaluation that takes whole models.

Both exports are written by the checkpoints' one atomic export (:func:`paravt_train.infra.checkpoint.atomic_directory`,
:func:`~paravt_train.infra.checkpoint.write_model_dir`). The reference policy of GRPO's KL term is the base itself
(the adapter disabled): no second copy is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoraSettings", "adapter_base", "adapter_state", "export_merged", "is_adapter_dir", "is_lora",
           "load_adapter", "lora_config", "save_adapter", "wrap"]


def is_adapter_dir(path) -> bool:
    """Whether ``path`` is a LoRA adapter directory (peft's ``adapter_config.json``, no model ``config.json``): the one
    answer the syncs, the versions and the gate share."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def adapter_base(path) -> str:
    """The base model an adapter directory was trained on (peft's ``base_model_name_or_path``)."""
    return json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]


class LoraSettings(BaseModel):
    """LoRA adapters (peft) instead of full fine-tuning; merged into the final model."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Module names (suffixes) to adapt; the vision tower's `qkv`/`proj` are left out by default.",
    )


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def lora_config(settings: LoraSettings):
    """peft's ``LoraConfig`` of ``settings``."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), bias="none")


def wrap(model, settings: LoraSettings):
    """The model with LoRA adapters on ``settings.target_modules``; only the adapters train."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(settings))


def adapter_state(model) -> dict:
    """The adapter's tensors by peft's names (``...lora_A.weight``), on the CPU; every rank calls it under FSDP2
    (the full tensors are gathered), rank 0 gets them."""
    from peft import get_peft_model_state_dict

    # lazy: the settings above are read by configs (the CLI's --help) that must not import torch
    from paravt_train.infra.distributed import rank_world

    _, world = rank_world()
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return get_peft_model_state_dict(model, state_dict=full)
    return {k: v.detach().to("cpu").clone() for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model, path: str | Path, settings: LoraSettings, base: str) -> Path:
    """A peft adapter directory at ``path`` (every rank calls it; rank 0 writes, atomically)."""
    from safetensors.torch import save_file

    # lazy: the settings above are read by configs (the CLI's --help) that must not import torch
    from paravt_train.infra.checkpoint import atomic_directory
    from paravt_train.infra.distributed import barrier, rank_world

    path = Path(path)
    state = adapter_state(model)
    rank, _ = rank_world()
    if rank == 0:
        with atomic_directory(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
            cfg = lora_config(settings).to_dict()
            cfg.update(base_model_name_or_path=str(base), peft_type="LORA", task_type=None)
            (tmp / "adapter_config.json").write_text(json.dumps(_jsonable(cfg), indent=1))
    barrier()
    return path


def load_adapter(model, path: str | Path) -> None:
    """A saved adapter directory's tensors into the peft ``model`` (a kept LoRA version)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(Path(path) / "adapter_model.safetensors")))


def export_merged(model, processor, base: str, path: str | Path, settings: LoraSettings,
                  agent_config_yaml: str | None) -> Path:
    """A plain model directory: a fresh copy of ``base`` with the trained adapter merged in (every rank calls it:
    gathering the adapter is a collective; rank 0 writes, atomically)."""
    import torch
    from peft import set_peft_model_state_dict
    from transformers import AutoModelForImageTextToText

    # lazy: the settings above are read by configs (the CLI's --help) that must not import torch
    from paravt_train.infra.checkpoint import write_model_dir
    from paravt_train.infra.distributed import barrier, rank_world

    state = adapter_state(model)
    rank, _ = rank_world()
    path = Path(path)
    if rank == 0:
        fresh = wrap(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), settings)
        set_peft_model_state_dict(fresh, state)
        write_model_dir(fresh.merge_and_unload(), processor, path, agent_config_yaml)
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
