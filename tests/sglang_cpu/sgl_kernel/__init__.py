"""ParaVT's pure-torch stand-in for ``sgl_kernel`` (SGLang's compiled kernels), for SGLang 0.5.23's CPU path in the
test set-up. The project's own code, not SGLang's; **pinned to sglang==0.5.23**: which names exist follows what
that release imports on an x86 CPU without AMX (``_names.py`` lists each with the sglang file:line that needs it).
Another SGLang release may import other names or call other kernels: the install checks the version, and any
kernel reached that is not implemented raises NotImplementedError naming itself.

* ``assign_req_to_token_pool_cpu`` is implemented (``memory.py``), also as
  ``torch.ops.sgl_kernel.assign_req_to_token_pool_cpu``.
* Every other name SGLang's CPU path imports or looks up exists and raises NotImplementedError when called.
* Pinned host memory is a no-op without CUDA in SGLang's processes (``pinning.py``): SGLang's LoRA path pins
  unconditionally, which would otherwise stop ``--enable-lora`` on CPU.
* Names SGLang probes for (``hasattr`` / try-import, ``_names.PROBED``) are left out on purpose, so SGLang takes its
  own torch fallbacks (``cpu_has_amx_support()`` stays False: no AMX kernel is ever chosen).
"""

from __future__ import annotations

import sys

import torch

from ._names import CALL_TIME, IMPORT_TIME, OPS_CALL_TIME, OPS_IMPORT_TIME, SGLANG_VERSION
from ._stub import define_ops, make_function
from .memory import assign_req_to_token_pool_cpu_impl
from .pinning import allow_pinning_without_cuda

__version__ = "0.0.1+paravt.cpu"
__all__ = ["SGLANG_VERSION", "assign_req_to_token_pool_cpu"]

_lib = torch.library.Library("sgl_kernel", "DEF")  # kept alive for the life of the process
_lib.define("assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
            "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()")
_lib.impl("assign_req_to_token_pool_cpu", assign_req_to_token_pool_cpu_impl, "CPU")
assign_req_to_token_pool_cpu = torch.ops.sgl_kernel.assign_req_to_token_pool_cpu

define_ops(_lib, sorted(set(OPS_IMPORT_TIME) | set(OPS_CALL_TIME)))

_module = sys.modules[__name__]
for _table in (IMPORT_TIME, CALL_TIME):
    for _name in _table.get("sgl_kernel", {}):
        if not hasattr(_module, _name):
            setattr(_module, _name, make_function(_name, "sgl_kernel"))
            __all__.append(_name)

if "sglang" in sys.modules:  # inside SGLang's processes only (the suite imports this module to test it)
    allow_pinning_without_cuda()

from . import flash_attn, mamba, speculative  # noqa: E402,F401  (submodules SGLang imports from)
