"""What the syncs make sure of on each server before they push to it, from what the server says about itself
(``GET /server_info``, :func:`~paravt_train.sync.http.server_facts`) and where it runs. Each guards against a
push that would take the server down (a scheduler exception kills SGLang, and every request in flight with it)
or leave it serving the wrong thing:

* :func:`tp_size_of`: the server's own tensor-parallel size. A tensor update carries one payload per TP rank and
  SGLang's ``tp_worker`` opens ``payloads[tp_rank]``: too few and the scheduler dies on the index, too many and
  the extra CUDA-IPC handles are never opened (their memory stays pinned on the sender's GPU, a model copy per
  push). A distributed update's group has ``1 + tp`` ranks (the trainer, then the server's ``rank_offset +
  tp_rank``).
* :func:`refuse_dp`: SGLang refuses tensor and distributed updates on a server started with ``--dp N > 1``.
* :func:`warn_vision_cache`: SGLang keeps its vision-feature cache across weight updates (no flush clears it), so
  a server whose vision tower is being trained must run with it off (``SGLANG_VLM_CACHE_SIZE_MB=0``,
  ``paravt serve --vlm-cache-mb 0``); the syncs warn when a server does not report that.
* :func:`refuse_unreachable_ipc`: SGLang opens a CUDA-IPC handle only on a GPU it can see (``utils/patch_torch.py``
  maps the sender's device UUID to one of its own devices, ``Invalid device_uuid`` otherwise), outside any
  ``try``: a tensor push from a GPU the server cannot see kills it. "The same GPU" is decided by UUID — the
  record ``paravt serve`` keeps of the GPUs it gave the server, else NVML's view of the server's processes — never
  by CUDA_VISIBLE_DEVICES strings (two Slurm tasks each call their own GPU "0"; a ``docker --gpus`` container has
  no variable at all); what cannot be told is refused, naming the alternatives.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from paravt_agent.errors import ConfigError
from paravt_train.sync.http import ServerFacts

__all__ = ["SenderGPU", "listening_pids", "nvml_gpu_uuids", "refuse_dp", "refuse_unreachable_ipc", "sending_gpu",
           "server_gpu_uuids", "tp_size_of", "warn_vision_cache"]


def tp_size_of(facts: ServerFacts, configured: int | None, warned: set, log=print) -> int:
    """The server's TP size. ``configured`` (``sglang_tp_size``) is used only for a server that does not report
    its own, with a warning (once per server); a configured size the server contradicts is noted and ignored."""
    if facts.tp_size is not None and facts.tp_size >= 1:
        if configured is not None and configured != facts.tp_size and ("tp", facts.url) not in warned:
            warned.add(("tp", facts.url))
            log(f"note: {facts.url} reports tp_size {facts.tp_size}; sglang_tp_size {configured} is ignored")
        return facts.tp_size
    if ("tp?", facts.url) not in warned:
        warned.add(("tp?", facts.url))
        log(f"warning: {facts.url} does not report its tp_size at /server_info; assuming "
            f"{configured or 1} (sglang_tp_size). A wrong size kills an SGLang server on a tensor update")
    return configured or 1


def refuse_dp(facts: ServerFacts, sync: str) -> None:
    """SGLang (``tokenizer_control_mixin``) refuses tensor and distributed updates when ``dp_size > 1``; a
    distributed update's group ranks are ``rank_offset + tp_rank``, so with ``pp_size > 1`` the stages' ranks
    collide."""
    if sync == "distributed" and facts.pp_size is not None and facts.pp_size > 1:
        raise ConfigError(f"{facts.url} runs pipeline-parallel (pp_size {facts.pp_size}): SGLang numbers a weight "
                          "update group's ranks by TP rank only, so its stages would collide; use sync.via disk "
                          "with such a server")
    if facts.dp_size is not None and facts.dp_size > 1:
        raise ConfigError(f"{facts.url} runs data-parallel (dp_size {facts.dp_size}), and SGLang refuses "
                          f"sync.via {sync} on such a server: serve the replicas as separate servers behind "
                          "sglang-router (`paravt serve --dp N` does), which the sync updates one by one, or use "
                          "sync.via disk")


def warn_vision_cache(facts: ServerFacts, warned: set, log=print) -> None:
    """Once per server: a push of vision-tower weights to a server that does not report its vision-feature cache
    off (SGLang keeps cached features across updates: image turns would be answered with the old tower's)."""
    if facts.vlm_cache_mb == 0 or ("vlm", facts.url) in warned:
        return
    warned.add(("vlm", facts.url))
    said = ("does not report its vision-feature cache size (servers `paravt serve` starts do)"
            if facts.vlm_cache_mb is None
            else f"keeps a vision-feature cache of {facts.vlm_cache_mb} MB")
    log(f"warning: this run trains the vision tower and {facts.url} {said}: SGLang keeps cached vision features "
        "across weight updates, so images it has seen are answered with the old tower's features. Serve it with "
        "`paravt serve --vlm-cache-mb 0` (SGLANG_VLM_CACHE_SIZE_MB=0)")


# ---------------------------------------------------------------------------------------------- CUDA IPC reach


@dataclass(frozen=True)
class SenderGPU:
    """The GPU a tensor push sends from: its ``CUDA_VISIBLE_DEVICES`` entry in this process (the physical index
    or UUID, or the ordinal when the variable is unset) and its UUID (``GPU-…``)."""

    entry: str
    uuid: str | None


def sending_gpu(device) -> SenderGPU | None:
    """The GPU ``device`` is, or None for a CPU device (CPU tensors go by value and open anywhere)."""
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return None
    import torch

    index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else []
    entry = entries[index] if index < len(entries) else str(index)
    return SenderGPU(entry=entry, uuid="GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-"))


def _local_host(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return any(a.startswith("127.") or a == "::1" or a in mine for a in addrs)


def listening_pids(port: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes that listen on TCP ``port`` on this machine (Linux ``/proc``; those of other users may be
    hidden)."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    pids = []
    if not inodes:
        return pids
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def nvml_gpu_uuids(pids: set[int], timeout: float = 10.0) -> set[str] | None:
    """The UUIDs of the GPUs on which any of ``pids`` holds a CUDA context, as NVML reports them (``nvidia-smi
    --query-compute-apps``); None when it cannot be asked (no driver tools here) or names none of them (another
    PID namespace: a container)."""
    import shutil
    import subprocess

    tool = shutil.which("nvidia-smi")
    if tool is None or not pids:
        return None
    try:
        out = subprocess.run([tool, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = {uuid.strip() for line in out.splitlines() if "," in line
             for pid, uuid in [line.split(",", 1)] if pid.strip().isdigit() and int(pid) in pids}
    return found or None


def server_gpu_uuids(url: str, proc: Path = Path("/proc")) -> tuple[set[str] | None, str]:
    """The GPUs (UUIDs) the server at ``url`` on this machine can open CUDA-IPC handles of, and where that was read:
    the record ``paravt serve`` wrote of the GPUs it gave the server (every GPU its CUDA_VISIBLE_DEVICES shows,
    :func:`~paravt_agent.serving.fleet.recorded_gpus`), else the GPUs NVML shows its processes on; (None,
    why) when neither can say (a server started otherwise, in a container, on a machine without the driver's
    tools)."""
    from paravt_agent.serving.fleet import recorded_gpus  # a record of paravt serve's, on this machine

    port = urlparse(url).port or (443 if urlparse(url).scheme == "https" else 80)
    pids = set(listening_pids(port, proc))
    recorded = recorded_gpus(port, pids)
    if recorded is not None:
        return set(recorded), "`paravt serve`'s record of the GPUs it gave the server"
    children = {int(c) for pid in pids for c in _children(proc, pid)}
    seen = nvml_gpu_uuids(pids | children)
    if seen is not None:
        return seen, "the GPUs NVML shows its processes on"
    return None, ("it was not started by `paravt serve` (which records the GPUs it gives a server)"
                  + ("" if pids else ", and no process of this machine listens on its port")
                  + ", and NVML shows none of its processes")


def _children(proc: Path, pid: int) -> list[str]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [k for t in (proc / str(p) / "task").iterdir() for k in (t / "children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += [int(k) for k in kids]
    return out


def refuse_unreachable_ipc(url: str, device, warned: set, log=print) -> None:
    """Before the first tensor push from ``device`` to ``url``: refuse (ConfigError) a server that cannot open
    CUDA-IPC handles from that GPU, decided by the GPU's UUID (the same GPU has the same UUID in every process,
    whatever each one's CUDA_VISIBLE_DEVICES or container calls it): on another machine; on this one without the
    GPU among the server's (:func:`server_gpu_uuids`); or when that cannot be told — SGLang dies on the first
    bucket of a GPU it cannot open ("Invalid device_uuid"), so unknown is refused too, naming the alternatives."""
    sender = sending_gpu(device)
    if sender is None:
        return
    fixes = ("use sync.via distributed (NCCL: any GPUs, any machine) or disk, or give the server the trainer's "
             "rank-0 GPU (co-locate them, and start the server with `paravt serve`, which records its GPUs)")
    host = urlparse(url).hostname or ""
    if not _local_host(host):
        raise ConfigError(f"sync.via tensor sends CUDA-IPC handles, which open only on the machine that made "
                          f"them, and {url} is on another host: {fixes}")
    uuids, source = server_gpu_uuids(url)
    if uuids is None:
        raise ConfigError(f"sync.via tensor would send CUDA-IPC handles of GPU {sender.uuid} to {url}, and which GPUs "
                          f"that server can open cannot be told here: {source}. SGLang dies on a handle of a GPU it "
                          f"cannot open (\"Invalid device_uuid\"): {fixes}")
    if not any(u == sender.uuid or sender.uuid.startswith(u) or u.startswith(sender.uuid) for u in uuids):
        raise ConfigError(f"sync.via tensor would send CUDA-IPC handles of GPU {sender.uuid} (this process's "
                          f"{sender.entry}) to {url}, whose GPUs are {', '.join(sorted(uuids))} ({source}): SGLang "
                          f"cannot open them and its scheduler dies (\"Invalid device_uuid\"). "
                          f"{fixes[0].upper()}{fixes[1:]}")
