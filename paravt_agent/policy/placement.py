"""Where and how the ``local`` backend runs its model: the device and dtype ``auto`` picks, and the one change it
makes to a model it loads (the vision patch embedding as a matrix product).

Why a small model stays on the CPU. A decoding step of a transformer runs a few hundred small operations (the
toy policy: ~1,100 ATen calls per step, measured by ``perf/bench_local_batching.py --profile``). On a GPU each
is a kernel launch of several microseconds whatever the tensor size, so a 1.2 M-parameter model is bound by
launches there: on one H200 the toy decoded 163 tokens/s against 379 on 2 CPU cores (``docs/performance.md``).
A step's own work grows with the weights it reads, so the GPU wins from a few tens of megabytes of weights on;
``auto`` puts a model on the GPU from :data:`GPU_MIN_WEIGHT_BYTES` on, and ``device="cuda"`` always does.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["GPU_MIN_WEIGHT_BYTES", "patch_embed_as_matmul", "resolve_device", "resolve_dtype", "weight_bytes"]

#: ``device="auto"`` uses a GPU for models with at least this many bytes of weights on disk (64 MiB: 16 M
#: float32 parameters); smaller ones decode faster on the CPU (see the module docstring).
GPU_MIN_WEIGHT_BYTES = 64 << 20


def weight_bytes(model_dir: str | Path) -> int:
    """The bytes of weight files (``*.safetensors``, ``*.bin``) in a model directory."""
    d = Path(model_dir)
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in d.glob(pattern))


def resolve_device(device: str, model_dir: str | Path) -> str:
    """``device`` itself unless it is ``auto``: then ``cuda`` when a GPU is present and the model in ``model_dir`` is
    large enough to gain from it (:data:`GPU_MIN_WEIGHT_BYTES`), else ``cpu``."""
    if device != "auto":
        return device
    import torch  # the backend that calls this has torch loaded already

    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if weight_bytes(model_dir) >= GPU_MIN_WEIGHT_BYTES else "cpu"


def resolve_dtype(dtype: str, device: str):
    """The torch dtype for ``dtype``: ``auto`` = bfloat16 on a GPU, float32 on the CPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def patch_embed_as_matmul(model) -> int:
    """Run every vision patch embedding whose ``Conv3d`` has its kernel equal to its stride (Qwen2.5-VL's and
    Qwen3-VL's: one output per non-overlapping patch) as the matrix product it is. Same weights, same values up
    to float rounding (~4e-6 in float32); 2-4x faster on the CPU, and on a GPU it needs no cuDNN convolution
    plan per new number of patches. Returns how many modules were changed."""
    import torch

    changed = 0
    for module in model.modules():
        conv = getattr(module, "proj", None)
        if not (type(module).__name__.endswith("PatchEmbed") and isinstance(conv, torch.nn.Conv3d)):
            continue
        if (tuple(conv.kernel_size) != tuple(conv.stride) or any(conv.padding) or conv.groups != 1
                or any(d != 1 for d in conv.dilation)):
            continue
        module.forward = _MatmulPatchEmbed(conv)
        changed += 1
    return changed


class _MatmulPatchEmbed:
    """``forward`` of a patch embedding: flattened patches (N, C·T·P·P) times the kernel (out, C·T·P·P)."""

    def __init__(self, conv):
        self.conv = conv

    def __call__(self, hidden_states):
        import torch

        w = self.conv.weight
        x = hidden_states.to(w.dtype).reshape(-1, w[0].numel())
        return torch.nn.functional.linear(x, w.reshape(w.shape[0], -1), self.conv.bias)
