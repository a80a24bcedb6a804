"""The one real kernel: assign_req_to_token_pool_cpu (pure torch, ParaVT's own code).

Semantics (SGLang's triton reference `assign_req_to_token_pool`, sglang/srt/mem_cache/allocation.py:692, called
from `assign_req_to_token_pool_func`, allocation.py:737-763, argument order as at allocation.py:746-753):
for request i (i = 0 .. len(req_pool_indices)-1), with s = start_offset[i], e = end_offset[i] and
o = sum_{j<i} (end_offset[j] - start_offset[j]):
    req_to_token[req_pool_indices[i], s:e] = out_cache_loc[o : o + (e - s)]
(`pool_len` is the row stride of req_to_token; the values are cast to req_to_token's dtype, as triton's store does.)

Unlike the triton kernel, which reads/writes out of bounds silently, this raises on inputs that would do so.
On the toy policy's path (no speculative decoding) SGLang only imports it; the suite's test checks it against
SGLang's triton kernel run in triton's CPU interpreter.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu_impl(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if start_offset.shape[0] < bs or end_offset.shape[0] < bs:
        raise ValueError(f"start_offset/end_offset have fewer than {bs} entries")
    if not req_to_token.is_contiguous():
        raise ValueError("req_to_token must be contiguous (rows are addressed with stride pool_len)")
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    start = start_offset.reshape(-1)[:bs].to(torch.int64)
    lengths = end_offset.reshape(-1)[:bs].to(torch.int64) - start
    if bool((lengths < 0).any()):
        raise ValueError("end_offset < start_offset for some request")
    total = int(lengths.sum())
    if total == 0:
        return
    if total > out_cache_loc.numel():
        raise IndexError(f"out_cache_loc has {out_cache_loc.numel()} entries, {total} needed")
    row_of = rows.repeat_interleave(lengths)
    seg_begin = torch.cumsum(lengths, 0) - lengths  # where request i's slice starts in out_cache_loc
    pos = torch.arange(total, dtype=torch.int64)
    col_of = start.repeat_interleave(lengths) + (pos - seg_begin.repeat_interleave(lengths))
    n_rows = req_to_token.numel() // pool_len if pool_len > 0 else 0
    if bool((col_of < 0).any()) or bool((col_of >= pool_len).any()) or bool((row_of < 0).any()) \
            or bool((row_of >= n_rows).any()):
        raise IndexError("assign_req_to_token_pool_cpu: a row or column is out of req_to_token's bounds")
    flat = req_to_token.view(-1)
    flat[row_of * pool_len + col_of] = out_cache_loc.reshape(-1)[:total].to(req_to_token.dtype)
