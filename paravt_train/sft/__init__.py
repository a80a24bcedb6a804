"""Supervised fine-tuning (the SFT cold start): :class:`~paravt_train.sft.config.SFTConfig` and
:func:`~paravt_train.sft.trainer.train` (assistant tokens only, LoRA optional, torchrun/FSDP2, exact resume)."""

_LAZY = {
    "LoraSettings": "paravt_train.sft.config",
    "SFTConfig": "paravt_train.sft.config",
    **{name: "paravt_train.sft.trainer" for name in ("assistant_labels", "build_example", "collate", "train")},
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):  # lazy: importing a submodule (e.g. the config) does not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
