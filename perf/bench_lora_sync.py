"""Bytes and seconds a weight push costs, full weights against a LoRA adapter (``sync.via: lora``), on a
randomly initialised Qwen3-VL-architecture model built here (CPU), and what they imply at 8 B.

    .venv/bin/python perf/bench_lora_sync.py [--hidden 1024] [--layers 12] [--rank 16]

* full: what ``sync.via: disk`` writes for the server per push (``ServerExport``: every tensor in bf16, one
  safetensors file per part of the model), then what a server reads back;
* adapter: what ``sync.via: lora`` writes (``save_adapter``: the peft adapter of rank ``--rank`` on the
  attention and MLP projections, the vision tower left out), then what the server reads back.

Seconds are wall time on this machine (the page cache included; on a cluster the filesystem dominates the full
push); the 8 B figures scale the bytes by parameter counts (Qwen3-VL-8B: 36 layers, hidden 4096, MLP 12288).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def lora_params(hidden: int, inter: int, layers: int, heads: int, kv: int, rank: int) -> int:
    """Adapter parameters on q, k, v, o, gate, up, down of every decoder layer (A: in × r, B: r × out)."""
    head = hidden // heads
    shapes = [(hidden, heads * head), (hidden, kv * head), (hidden, kv * head), (heads * head, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    return layers * sum(rank * (i + o) for i, o in shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from paravt_train.infra import lora
    from paravt_train.infra.checkpoint import ServerExport
    from paravt_train.infra.lora import LoraSettings

    heads, kv, inter = max(1, args.hidden // 128), max(1, args.hidden // 512), 3 * args.hidden
    cfg = Qwen3VLConfig(text_config={"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                     "num_attention_heads": heads, "num_key_value_heads": kv,
                                     "intermediate_size": inter, "vocab_size": 32000, "head_dim": 128,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
                        vision_config={"depth": 2, "hidden_size": 256, "num_heads": 4, "intermediate_size": 512,
                                       "out_hidden_size": args.hidden, "deepstack_visual_indexes": [0, 1]})
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        class Proc:  # the export writes a processor beside the weights: nothing to write here
            def save_pretrained(self, path):
                pass

        t0 = time.perf_counter()
        ServerExport(tmp / "full", Proc(), torch.bfloat16).write(model)
        full_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        for f in (tmp / "full").glob("*.safetensors"):
            sum(float(t.float().sum()) for t in load_file(str(f)).values())  # read and touch every byte
        full_read = time.perf_counter() - t0
        full_bytes = folder_bytes(tmp / "full")
        peft_model = lora.wrap(model, LoraSettings(enabled=True, r=args.rank, alpha=2 * args.rank))
        adapter_n = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        t0 = time.perf_counter()
        lora.save_adapter(peft_model, tmp / "adapter", LoraSettings(enabled=True, r=args.rank), "base")
        adapter_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        sum(float(t.float().sum()) for t in load_file(str(tmp / "adapter" / "adapter_model.safetensors")).values())
        adapter_read = time.perf_counter() - t0
        adapter_bytes = folder_bytes(tmp / "adapter")
    at8b_full = 8.77e9 * 2  # Qwen3-VL-8B in bf16
    at8b_adapter = lora_params(4096, 12288, 36, 32, 8, args.rank) * 4  # the adapter as the trainer keeps it (fp32)
    print(f"model: {n / 1e6:.0f} M parameters (hidden {args.hidden}, {args.layers} layers); adapter rank "
          f"{args.rank}: {adapter_n / 1e6:.2f} M ({100 * adapter_n / n:.2f} %)\n")
    print("| push | bytes | write (s) | read (s) | at 8 B |")
    print("|---|---|---|---|---|")
    print(f"| full weights (bf16, sync.via disk) | {full_bytes / 1e6:.1f} MB | {full_write:.2f} | "
          f"{full_read:.2f} | {at8b_full / 1e9:.1f} GB |")
    print(f"| LoRA adapter (sync.via lora) | {adapter_bytes / 1e6:.2f} MB | {adapter_write:.3f} | "
          f"{adapter_read:.3f} | {at8b_adapter / 1e6:.0f} MB |")
    print(f"\nbytes ratio {full_bytes / adapter_bytes:.0f}x here, {at8b_full / at8b_adapter:.0f}x at 8 B")


if __name__ == "__main__":
    main()
