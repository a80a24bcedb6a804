"""Pinned host memory on a machine without CUDA: a no-op instead of an error (SGLang 0.5.23's LoRA path).

SGLang 0.5.23's LoRA layers and LoRA backends allocate their host-side index tensors with ``pin_memory=True``
(``sglang/srt/lora/layers.py``, ``lora/backend/torch_backend.py``, ``lora/lora.py``) whatever the device; torch
answers "Found no NVIDIA driver" on a CPU-only machine, so ``--enable-lora`` kills the CPU server at start.
Pinning only speeds up host→GPU copies; with no GPU there is nothing to speed up, so here it is dropped:
``pin_memory=True`` on the factory functions SGLang's LoRA code calls, and ``Tensor.pin_memory()``, give the
ordinary CPU tensor. Installed only when CUDA is unavailable (on a GPU nothing changes)."""

from __future__ import annotations

import functools

import torch

#: the factories SGLang 0.5.23's LoRA code passes ``pin_memory=True`` to
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


def _unpinned(factory):
    @functools.wraps(factory)
    def call(*args, pin_memory: bool = False, **kwargs):
        return factory(*args, **kwargs)

    call.__paravt_unpinned__ = True
    return call


def allow_pinning_without_cuda() -> bool:
    """Make ``pin_memory`` a no-op when there is no CUDA; True when it was installed (now or before)."""
    if torch.cuda.is_available():
        return False
    for name in FACTORIES:
        factory = getattr(torch, name)
        if not getattr(factory, "__paravt_unpinned__", False):
            setattr(torch, name, _unpinned(factory))
    # the tensor itself, where torch returns a pinned copy: SGLang 0.5.23 only reads the tensors it pins
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    return True
