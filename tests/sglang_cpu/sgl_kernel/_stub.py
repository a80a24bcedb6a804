"""Loud placeholders: each name exists (so SGLang's modules import) and raises NotImplementedError when called."""

from __future__ import annotations

import torch

from ._names import OP_KWARGS, SGLANG_VERSION

NUM_POSITIONAL = 24  # more than any SGLang 0.5.23 call site passes (19 at most)


def message(name: str) -> str:
    return (f"sgl_kernel.{name} is not implemented by ParaVT's CPU kernels (pinned to sglang {SGLANG_VERSION}): only "
            "assign_req_to_token_pool_cpu is. This code path (speculative decoding, the intel_amx attention backend, "
            "seeded sampling, linear-attention / MoE / quantised models, ...) is not supported by the suite's CPU "
            "set-up (tests/sglang_cpu, docs/verified_on_cpu.md).")


def make_function(name: str, module: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(message(name))

    stub.__name__ = stub.__qualname__ = name
    stub.__module__ = module
    stub.__doc__ = f"Placeholder for sgl_kernel's {name}: always raises NotImplementedError."
    return stub


def define_ops(lib: torch.library.Library, names) -> None:
    """Register ``torch.ops.sgl_kernel.NAME`` for each name with a catch-all schema (optional ``Any`` arguments:
    positional a0..a23 plus the keyword names SGLang passes), so every call reaches the NotImplementedError."""
    for name in names:
        params = [f"Any? a{i}=None" for i in range(NUM_POSITIONAL)]
        params += [f"Any? {kw}=None" for kw in OP_KWARGS.get(name, [])]
        lib.define(f"{name}({', '.join(params)}) -> Any")

        def impl(*args, _name=name, **kwargs):
            raise NotImplementedError(message(_name))

        lib.impl(name, impl, "CompositeExplicitAutograd")
