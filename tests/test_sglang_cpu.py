"""SGLang's own server on CPU, as the suite sets it up (``make sglang-cpu``, tests/sglang_cpu): the project's CPU
stand-in for SGLang's compiled kernels (pinned to sglang 0.5.23), checked against the semantics of SGLang's own
triton kernel. (``paravt serve --device cpu`` serving the toy policy, and stopping on SIGTERM: tests/test_hosts.py,
whose fleet it starts.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import engine_unavailable
from tests.sglang_cpu import sgl_kernel
from tests.sglang_cpu.server import PYTHON, unavailable
from tests.sglang_cpu.sgl_kernel import _names

HERE = Path(__file__).resolve().parent / "sglang_cpu"


def reference(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The semantics, as plainly as possible: request i fills row req_pool_indices[i], columns
    [start_offset[i], end_offset[i]), with the next (end - start) entries of out_cache_loc."""
    out = req_to_token.clone()
    taken = 0
    for i in range(len(req_pool_indices)):
        row, s, e = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        for j in range(e - s):
            out.view(-1)[row * pool_len + s + j] = out_cache_loc[taken + j]
        taken += e - s
    return out


def random_case(gen, bs, rows, pool_len, dtype_idx=torch.int64):
    req_pool_indices = torch.randperm(rows, generator=gen)[:bs].to(dtype_idx)
    start = torch.randint(0, pool_len, (bs,), generator=gen)
    length = torch.stack([torch.randint(0, pool_len - int(s) + 1, (1,), generator=gen)[0] for s in start])
    end = start + length
    spare = int(torch.randint(0, 3, (1,), generator=gen))
    out_cache_loc = torch.randint(1, 10_000, (int(length.sum()) + spare,), generator=gen, dtype=torch.int64)
    req_to_token = torch.randint(-5, 0, (rows, pool_len), generator=gen).to(torch.int32)
    return req_pool_indices, req_to_token, start.to(dtype_idx), end.to(dtype_idx), out_cache_loc


def test_the_cpu_kernel_matches_its_reference_and_refuses_what_would_go_out_of_bounds():
    """assign_req_to_token_pool_cpu (SGLang's call-site argument order, int32 and int64 indices, through the
    module and torch.ops) against a plain loop; inputs the triton kernel would read or write out of bounds with
    are refused, the table untouched."""
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        bs = int(torch.randint(1, 9, (1,), generator=gen))
        pool_len = int(torch.randint(1, 80, (1,), generator=gen))
        case = random_case(gen, bs, bs + int(torch.randint(0, 5, (1,), generator=gen)), pool_len,
                           torch.int64 if seed % 2 else torch.int32)
        got = case[1].clone()
        op = sgl_kernel.assign_req_to_token_pool_cpu if seed % 3 else torch.ops.sgl_kernel.assign_req_to_token_pool_cpu
        op(case[0], got, case[2], case[3], case[4], pool_len)
        assert torch.equal(got, reference(*case, pool_len)) and got.dtype == torch.int32
    t = torch.zeros(3, 8, dtype=torch.int32)  # by hand, in allocation.py's argument order
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), t, torch.tensor([1, 0]), torch.tensor([3, 4]),
                                            torch.arange(10, 16), t.shape[1])
    assert t.tolist() == [[12, 13, 14, 15, 0, 0, 0, 0], [0] * 8, [0, 10, 11, 0, 0, 0, 0, 0]]
    for rpi, s, e, loc in [([0], [3], [1], 2), ([0], [3], [5], 2), ([2], [0], [2], 2), ([0], [0], [2], 1)]:
        t = torch.zeros(2, 4, dtype=torch.int32)
        with pytest.raises((ValueError, IndexError)):
            sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor(rpi), t, torch.tensor(s), torch.tensor(e),
                                                    torch.arange(loc), 4)
        assert (t == 0).all()


def test_every_other_kernel_fails_loudly_and_probed_names_stay_absent():
    """Every name SGLang 0.5.23 imports or looks up on this CPU path exists (so its modules import) and raises
    NotImplementedError naming itself and the pin when called, keywords SGLang passes included; the names SGLang
    probes for are absent, so it takes its own torch fallbacks (no AMX path, no seeded-sampling kernel)."""
    import importlib

    assert _names.SGLANG_VERSION == "0.5.23"
    stubs = []
    for table in (_names.IMPORT_TIME, _names.CALL_TIME):
        for module, entries in table.items():
            mod = importlib.import_module(module.replace("sgl_kernel", "tests.sglang_cpu.sgl_kernel", 1))
            stubs += [(name, getattr(mod, name)) for name in entries if name != "assign_req_to_token_pool_cpu"]
    stubs += [(op, getattr(torch.ops.sgl_kernel, op)) for op in set(_names.OPS_IMPORT_TIME) | set(_names.OPS_CALL_TIME)]
    assert len(stubs) > 60
    for name, fn in stubs:
        with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name} is not implemented by ParaVT's CPU "
                                                      r"kernels \(pinned to sglang 0\.5\.23\)"):
            fn(torch.ones(2), torch.ones(2), 3)
    with pytest.raises(NotImplementedError):
        torch.ops.sgl_kernel.topk_softmax_cpu(hidden_states=torch.ones(2, 4), gating_output=torch.ones(2, 8),
                                              topk=2, renormalize=True)
    for full in _names.PROBED:
        name = full.rsplit(".", 1)[1]
        if full.startswith("torch.ops.sgl_kernel."):
            assert not hasattr(torch.ops.sgl_kernel, name), full
        else:
            assert not hasattr(sgl_kernel, name), full


PINNING = textwrap.dedent("""
    import torch
    from tests.sglang_cpu.sgl_kernel.pinning import allow_pinning_without_cuda
    try:
        torch.tensor([1, 2], dtype=torch.int32, pin_memory=True)
        print("PINNED")
    except RuntimeError as exc:
        print("REFUSED", "NVIDIA" in str(exc) or "CUDA" in str(exc) or "accelerator" in str(exc))
    assert allow_pinning_without_cuda() and allow_pinning_without_cuda()  # idempotent: wrapped once
    assert not getattr(torch.tensor.__wrapped__, "__paravt_unpinned__", False)
    t = torch.tensor([1, 2], dtype=torch.int32, pin_memory=True)
    e = torch.empty((3,), dtype=torch.int32, pin_memory=True)
    z = torch.zeros(2, pin_memory=True)
    o = torch.ones_like(t).pin_memory()
    print("AFTER", t.tolist(), t.dtype, e.shape[0], z.tolist(), o.tolist(), o.device)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, pinning works and the module leaves it alone")
def test_pinned_host_memory_is_a_no_op_without_cuda_in_sglangs_processes():
    """SGLang 0.5.23's LoRA layers pin host memory unconditionally, which torch refuses without a CUDA driver (so
    ``--enable-lora`` killed the CPU server at start). In a process where the CPU module makes pinning a no-op, the
    factories SGLang calls give ordinary CPU tensors; the module changes nothing in a process that is not SGLang's
    (this one imported it)."""
    proc = subprocess.run([sys.executable, "-c", PINNING], capture_output=True, text=True, timeout=120,
                          cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED True" in proc.stdout
    assert "AFTER [1, 2] torch.int32 3 [0.0, 0.0] [1, 1] cpu" in proc.stdout
    assert not getattr(torch.tensor, "__paravt_unpinned__", False)
    with pytest.raises(RuntimeError):
        torch.tensor([1], pin_memory=True)


TRITON = textwrap.dedent("""
    import json, sys, torch
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool, next_power_of_2
    out = []
    for c in json.loads(sys.stdin.read()):
        t = torch.tensor(c["req_to_token"], dtype=torch.int32)
        bs = len(c["rpi"])
        assign_req_to_token_pool[(bs,)](torch.tensor(c["rpi"]), t, torch.tensor(c["start"]), torch.tensor(c["end"]),
                                        torch.tensor(c["loc"], dtype=torch.int64), t.shape[1], next_power_of_2(bs))
        out.append(t.tolist())
    print("RESULT" + json.dumps(out))
""")


def test_the_cpu_kernel_agrees_with_sglangs_triton_kernel():
    """The same random cases through SGLang 0.5.23's own triton kernel (``assign_req_to_token_pool``, run in
    triton's CPU interpreter, in the SGLang venv) and through the project's torch version: identical tables."""
    engine_unavailable(unavailable())
    cases, inputs = [], []
    for seed in range(12):
        gen = torch.Generator().manual_seed(1000 + seed)
        bs = int(torch.randint(1, 7, (1,), generator=gen))
        pool_len = int(torch.randint(1, 70, (1,), generator=gen))
        case = random_case(gen, bs, bs + 2, pool_len)
        inputs.append((case, pool_len))
        cases.append({"req_to_token": case[1].tolist(), "rpi": case[0].tolist(), "start": case[2].tolist(),
                      "end": case[3].tolist(), "loc": case[4].tolist()})
    env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_USE_CPU_ENGINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([str(PYTHON), "-c", TRITON], input=json.dumps(cases), env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    for (case, pool_len), tri in zip(inputs, json.loads(line[len("RESULT"):]), strict=True):
        got = case[1].clone()
        sgl_kernel.assign_req_to_token_pool_cpu(case[0], got, case[2], case[3], case[4], pool_len)
        assert got.tolist() == tri
