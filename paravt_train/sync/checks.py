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
  ``try``: a tensor push from a GPU the server cannot see kills it. The server's GPUs are read from the process
  that listens on its port (its ``CUDA_VISIBLE_DEVICES``), on this machine.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from paravt_agent.errors import ConfigError
from paravt_train.sync.http import ServerFacts

__all__ = ["SenderGPU", "gpu_visible", "listening_pids", "refuse_dp", "refuse_unreachable_ipc", "sending_gpu",
           "server_visible_devices", "tp_size_of", "warn_vision_cache"]


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


def gpu_visible(sender: SenderGPU, server_devices: str | None) -> bool | None:
    """Whether a server whose ``CUDA_VISIBLE_DEVICES`` is ``server_devices`` sees ``sender``'s GPU: True when the
    variable is unset (every GPU) or names it (by index, by UUID or a UUID prefix, as CUDA accepts); False when it
    names GPUs in the sender's form and not this one; None when the forms differ and cannot be compared here."""
    if server_devices is None:
        return True
    entries = [e.strip() for e in server_devices.split(",") if e.strip()]
    if not entries:
        return False  # an empty list hides every GPU
    for e in entries:
        if e == sender.entry or (e.startswith(("GPU-", "MIG-")) and sender.uuid and sender.uuid.startswith(e)):
            return True
    numeric_server, numeric_sender = all(e.isdigit() for e in entries), sender.entry.isdigit()
    if numeric_server and numeric_sender:
        return False
    if all(e.startswith("GPU-") for e in entries) and sender.uuid:
        return False
    return None


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


def server_visible_devices(url: str, proc: Path = Path("/proc")) -> tuple[bool, str | None]:
    """``(found, CUDA_VISIBLE_DEVICES)`` of the server at ``url`` on this machine, read from the environment of
    the process listening on its port; ``found`` is False when no such process can be read here."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    for pid in listening_pids(port, proc):
        try:
            raw = (proc / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        value = env.get(b"CUDA_VISIBLE_DEVICES")
        return True, None if value is None else value.decode(errors="replace")
    return False, None


def refuse_unreachable_ipc(url: str, device, warned: set, log=print) -> None:
    """Before the first tensor push from ``device`` to ``url``: refuse (ConfigError) a server that cannot open
    CUDA-IPC handles from that GPU — on another machine, or on this one without the GPU among its
    ``CUDA_VISIBLE_DEVICES`` (SGLang would die on the first bucket) — and warn when it cannot be told here."""
    sender = sending_gpu(device)
    if sender is None:
        return
    fixes = ("use sync.via distributed (NCCL: any GPUs, any machine), or give the server the trainer's rank-0 "
             "GPU (co-locate them on the same GPUs, or list that GPU in the server's CUDA_VISIBLE_DEVICES)")
    host = urlparse(url).hostname or ""
    if not _local_host(host):
        raise ConfigError(f"sync.via tensor sends CUDA-IPC handles, which open only on the machine that made "
                          f"them, and {url} is on another host: {fixes}")
    found, devices = server_visible_devices(url)
    visible = gpu_visible(sender, devices) if found else None
    if visible is False:
        raise ConfigError(f"sync.via tensor would send CUDA-IPC handles of GPU {sender.entry} ({sender.uuid}) to "
                          f"{url}, which sees only CUDA_VISIBLE_DEVICES={devices}: SGLang cannot open them and its "
                          f"scheduler dies (\"Invalid device_uuid\"). {fixes[0].upper()}{fixes[1:]}")
    if visible is None and ("ipc", url) not in warned:
        warned.add(("ipc", url))
        log(f"warning: cannot tell whether {url} sees GPU {sender.entry} ({sender.uuid}): "
            + ("its process is not readable here" if not found else f"its CUDA_VISIBLE_DEVICES is {devices}")
            + ". SGLang dies on a CUDA-IPC handle of a GPU it cannot see; if it does not, " + fixes)
