"""Seconds and peak memory per weight sync, for the three ways weights reach a rollout server, on a synthetic
state dict of >= 1 B parameters (CPU), and the 8 B figures they imply.

    .venv/bin/python perf/bench_sync.py [--params 1.0e9] [--bucket-mb 512] [--dtype bfloat16]

* ``disk``: the trainer writes the weights (safetensors) and the server reads them back
  (``/update_weights_from_disk``).
* ``tensor``: buckets serialised as SGLang's named tensors (by value on CPU: the bytes travel in the payload, as
  they must for a server that is not the trainer's child; CUDA IPC handles on GPUs, one copy per TP rank) and
  opened and copied by a receiving process (``/update_weights_from_tensor``).
* ``distributed``: buckets announced and broadcast over a process group to a receiving process
  (``/update_weights_from_distributed``; gloo here, NCCL on GPUs).

Each mode runs in fresh processes; "sender peak" is the trainer process's peak RSS above the state dict it
already holds (what the sync itself costs: the whole gathered model for ``disk``, at most two buckets for the
streamed syncs), "receiver peak" the server stand-in's above its own copy of the weights. The implied 8 B figures
scale bytes linearly; they are CPU numbers (memory bandwidth, gloo over loopback, the page cache): on GPUs NCCL
and CUDA IPC move the bytes far faster, while the disk path stays bound by the filesystem.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_state(params: float, dtype):
    """~``params`` parameters as 64 layer-like tensors (plus an embedding), in ``dtype``."""
    import torch

    n_layers = 64
    per = int(params / (n_layers + 1))
    side = int(per ** 0.5)
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(side, side, generator=g).to(dtype)}
    for i in range(n_layers):
        state[f"model.layers.{i}.weight"] = torch.randn(side, side, generator=g).to(dtype)
    return state


def buckets(state: dict, bucket_bytes: int):
    bucket, size = [], 0
    for name, t in state.items():
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


# ------------------------------------------------------------------ receivers (the server stand-in's work)


def receive_tensor(conn, params: float, dtype_name: str) -> None:
    import base64
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - tensor reductions

    own = synthetic_state(params, getattr(torch, dtype_name))  # the server's own copy of the weights
    base = peak_mb()
    conn.recv()
    conn.send("ready")
    while True:
        payload = conn.recv()
        if payload is None:
            break
        for name, t in ForkingPickler.loads(base64.b64decode(payload)):
            own[name].copy_(t)
        conn.send("ok")
    conn.send(peak_mb() - base)


def receive_distributed(port: int, params: float, dtype_name: str, n_buckets: list, conn) -> None:
    import torch
    import torch.distributed as dist

    own = synthetic_state(params, getattr(torch, dtype_name))  # the server's own copy of the weights
    base = peak_mb()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    for names in n_buckets:
        for name in names:
            t = torch.empty_like(own[name])
            dist.broadcast(t, src=0)
            own[name].copy_(t)
    conn.send(peak_mb() - base)
    dist.destroy_process_group()


# ------------------------------------------------------------------ one mode, in a fresh process


def run_mode(mode: str, params: float, bucket_mb: int, dtype_name: str) -> dict:
    import multiprocessing as mp

    import torch

    dtype = getattr(torch, dtype_name)
    state = synthetic_state(params, dtype)
    n = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    bucket_bytes = bucket_mb << 20
    base = peak_mb()
    ctx = mp.get_context("spawn")  # a fork after torch's thread pools started can hang the child
    out = {"mode": mode, "params": n, "gb": nbytes / 1e9}
    if mode == "disk":
        from safetensors.torch import load_file, save_file

        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
            t0 = time.perf_counter()
            full = {k: v.clone() for k, v in state.items()}  # the full state dict gathered onto rank 0's CPU
            save_file(full, f"{d}/model.safetensors")
            del full
            t_write = time.perf_counter() - t0
            recv_base = peak_mb()
            t1 = time.perf_counter()
            loaded = load_file(f"{d}/model.safetensors")
            for k, v in loaded.items():  # the server copies into its own parameters
                state[k].copy_(v)
            t_read = time.perf_counter() - t1
            out.update(seconds=t_write + t_read, write_s=t_write, read_s=t_read,
                       receiver_peak_mb=peak_mb() - recv_base)
            del loaded
    elif mode == "tensor":
        from paravt_train.sync.streamed import serialize_named_tensors

        parent, child = ctx.Pipe()
        proc = ctx.Process(target=receive_tensor, args=(child, params, dtype_name))
        proc.start()
        parent.send("ready?")  # wait until the receiver holds its copy: only the transfer is timed
        parent.recv()
        t0 = time.perf_counter()
        for bucket in buckets(state, bucket_bytes):
            parent.send(serialize_named_tensors([(k, v.clone()) for k, v in bucket]))  # a gathered bucket
            parent.recv()
        parent.send(None)
        out["seconds"] = time.perf_counter() - t0
        out["receiver_peak_mb"] = parent.recv()
        proc.join()
    else:
        import socket

        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        names = [[k for k, _ in b] for b in buckets(state, bucket_bytes)]
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=receive_distributed, args=(port, params, dtype_name, names, child))
        proc.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        t0 = time.perf_counter()
        for bucket in buckets(state, bucket_bytes):
            for _, t in [(k, v.clone()) for k, v in bucket]:  # a gathered bucket
                dist.broadcast(t, src=0)
        out["seconds"] = time.perf_counter() - t0
        out["receiver_peak_mb"] = parent.recv()
        proc.join()
        dist.destroy_process_group()
    out["sender_peak_mb"] = peak_mb() - base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.0e9)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--modes", default="disk,tensor,distributed")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_mode(args.worker, args.params, args.bucket_mb, args.dtype)))
        return
    from tqdm.auto import tqdm

    rows = []
    for mode in tqdm(args.modes.split(","), desc="sync modes"):
        run = subprocess.run([sys.executable, __file__, "--worker", mode, "--params", str(args.params),
                              "--bucket-mb", str(args.bucket_mb), "--dtype", args.dtype],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if run.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{run.stderr[-3000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    scale = 8e9 / rows[0]["params"]
    print(f"\n{rows[0]['params'] / 1e9:.2f} B parameters ({rows[0]['gb']:.2f} GB in {args.dtype}), "
          f"buckets of {args.bucket_mb} MB; the 8 B column scales bytes linearly\n")
    print("| sync | seconds | sender peak (MB) | receiver peak (MB) | implied at 8 B: seconds | sender peak (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sender_8b = r["sender_peak_mb"] * (1 if r["mode"] != "disk" else scale)
        print(f"| {r['mode']} | {r['seconds']:.1f} | {r['sender_peak_mb']:.0f} | {r['receiver_peak_mb']:.0f} | "
              f"{r['seconds'] * scale:.0f} | {sender_8b:.0f} |")
    disk = next((r for r in rows if r["mode"] == "disk"), None)
    if disk is not None and args.dtype != "float32":
        # the trainer holds fp32 weights and export_model writes them as they are: a disk sync moves fp32 bytes
        up = 4 / (disk["gb"] * 1e9 / disk["params"])
        print(f"\ndisk in the trainer: fp32, not {args.dtype} (paravt_train/infra/checkpoint.py export_model "
              "writes the "
              f"fp32 weights it holds): at 8 B {8e9 * 4 / 1e9:.0f} GB, ~{disk['seconds'] * scale * up:.0f} s and "
              f"~{disk['sender_peak_mb'] * scale * up / 1000:.0f} GB of sender peak (--dtype float32 measures it)")


if __name__ == "__main__":
    main()
