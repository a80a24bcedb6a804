"""Several SGLang servers as one service, and what other processes on the machine need to know of them:

* ``paravt serve --dp N``: N workers behind ``sglang-router`` (:func:`router_commands`, :func:`launch_router`),
  registered under an address other hosts reach (:func:`worker_address`), so a trainer elsewhere pushes to them;
* the record of the GPUs a server was given (:func:`record_gpus`, :func:`recorded_gpus`), by UUID, which a trainer's
  tensor sync on the same machine decides "the same GPU" by.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from paravt_agent.errors import PolicyError
from paravt_agent.serving.sglang_launch import launch, sglang_command, stop, wait_healthy

__all__ = ["launch_router", "record_gpus", "recorded_gpus", "router_commands", "visible_gpu_uuids", "wait_listed",
           "worker_address"]


def worker_address(host: str, worker_host: str | None = None) -> tuple[str, str]:
    """``(bind, advertised)`` address of ``--dp`` workers: they listen where the router does (``host``) or on
    ``worker_host``, and are registered with the router under an address other hosts reach — ``worker_host``, the
    serve host when it is one, else this machine's (a wildcard ``host`` is no address: the hostname's). Registered
    as 127.0.0.1 they could be reached only from this host, and a trainer elsewhere would push to its own."""
    import socket

    wildcard = host in ("0.0.0.0", "::", "")
    bind = worker_host or host
    if worker_host:
        return ("0.0.0.0" if wildcard else worker_host), worker_host
    if not wildcard:
        return bind, host
    try:
        advertised = socket.gethostbyname(socket.gethostname())
    except OSError:
        raise ValueError("--host is a wildcard and this machine's hostname resolves to no address: name the address "
                         "other hosts reach the workers at with --worker-host") from None
    return "0.0.0.0", advertised


def router_commands(
    model: str, dp: int, host: str = "127.0.0.1", port: int = 30000, tp: int = 1, policy: str = "cache_aware",
    worker_host: str | None = None, **worker_kw,
) -> tuple[list[tuple[list[str], dict[str, str]]], list[str]]:
    """``dp`` SGLang workers (ports ``port+1 … port+dp``, ``tp`` GPUs each from ``--base-gpu-id``) and the
    ``sglang-router`` in front of them on ``port``: ``([(worker argv, env), ...], router argv)``.

    Workers listen and are registered under :func:`worker_address` (an address other hosts reach: a trainer on
    another host pushes its weights to each worker the router lists). ``cache_aware`` routing sends requests
    that share a prefix (a question's G rollouts, a planner's later turns) to the worker that holds it in its radix
    cache. With an ``api_key`` the router takes it too (and passes it to the workers)."""
    if dp < 1:
        raise ValueError("dp must be at least 1")
    bind, advertised = worker_address(host, worker_host)
    workers, urls = [], []
    for i in range(dp):
        wport = port + 1 + i
        argv, env = sglang_command(model, bind, wport, tp, **worker_kw)
        gpu = ["--base-gpu-id", str(i * tp)] if worker_kw.get("device", "cuda") == "cuda" else []
        workers.append((argv + gpu, env))
        urls.append(f"http://{advertised}:{wport}")
    router = [worker_kw.get("python") or sys.executable, "-m", "sglang_router.launch_router", "--host", host,
              "--port", str(port), "--policy", policy, "--worker-urls", *urls]
    if worker_kw.get("api_key"):
        router += ["--api-key", worker_kw["api_key"]]
    return workers, router


def launch_router(workers: list[tuple[list[str], dict[str, str]]], router: list[str], host: str, port: int,
                  timeout: float = 900.0) -> list[subprocess.Popen]:
    """Start the workers side by side, wait until each is healthy, then the router, until it lists every worker
    (what a client or a trainer's sync finds at ``GET /workers``); every process is stopped if any fails."""
    if router[0] == sys.executable and importlib.util.find_spec("sglang_router") is None:
        raise PolicyError("sglang-router is not installed: `pip install sglang-router` (or 'paravt[sglang]')")
    procs: list[subprocess.Popen] = []
    urls = router[router.index("--worker-urls") + 1:]
    urls = urls[: next((i for i, u in enumerate(urls) if u.startswith("--")), len(urls))]
    key = router[router.index("--api-key") + 1] if "--api-key" in router else None
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        for (argv, env), url in zip(workers, urls, strict=True):
            whost, _, wport = url.removeprefix("http://").rpartition(":")
            procs.append(launch(argv, env, whost, int(wport), timeout=timeout, wait=False))
        for proc, url in zip(procs, urls, strict=True):
            wait_healthy(url, timeout=timeout, proc=proc)
        proc = subprocess.Popen(router, start_new_session=True)
        procs.append(proc)
        wait_healthy(f"http://{local}:{port}", timeout=120, proc=proc)
        wait_listed(f"http://{local}:{port}", urls, key, proc=proc)
    except BaseException:
        for p in procs:
            stop(p)
        raise
    return procs


def wait_listed(router: str, urls: list[str], key: str | None = None, timeout: float = 120.0,
                proc: subprocess.Popen | None = None) -> None:
    """Wait until the router at ``router`` lists every worker of ``urls`` (it adds one once it answers its first
    checks: seconds after the router is up)."""
    import httpx  # `paravt serve --dp` only: the module is read by the CLI's start-up

    # the policy layer's one reading of a router's workers, here at launch only
    from paravt_agent.policy.endpoints import bearer, router_workers

    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while set(router_workers(client, router, bearer(key)) or []) != {u.rstrip("/") for u in urls}:
            if proc is not None and proc.poll() is not None:
                raise PolicyError(f"the router exited with code {proc.returncode} before listing its workers")
            if time.monotonic() > deadline:
                raise PolicyError(f"{router} did not list its workers {urls} within {timeout:.0f}s")
            time.sleep(0.5)


def _gpu_record(port: int) -> Path:
    import tempfile

    return Path(tempfile.gettempdir()) / "paravt-servers" / f"{port}.json"


def record_gpus(port: int, pid: int, uuids: list[str]) -> Path:
    """Record, on this machine, the GPUs (UUIDs) a server on ``port`` (process ``pid``) can open CUDA-IPC handles of:
    what a trainer's tensor sync decides "the same GPU" by (two processes may call one GPU by other indices)."""
    import json

    path = _gpu_record(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": pid, "gpu_uuids": list(uuids)}))
    os.replace(tmp, path)
    return path


def recorded_gpus(port: int, pids: set[int]) -> list[str] | None:
    """The GPUs :func:`record_gpus` recorded for the server on ``port``, when the process it names is one of
    ``pids`` (the processes listening there now: a record left by an earlier server is no answer)."""
    import json

    try:
        data = json.loads(_gpu_record(port).read_text())
    except (OSError, ValueError):
        return None
    return list(data.get("gpu_uuids") or []) if data.get("pid") in pids else None


def visible_gpu_uuids() -> list[str]:
    """The UUIDs (``GPU-…``) of the GPUs this process's CUDA_VISIBLE_DEVICES shows (a server started with the same
    environment sees the same); none without CUDA."""
    import torch  # paravt serve on a GPU machine only

    if not torch.cuda.is_available():
        return []
    return ["GPU-" + str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-")
            for i in range(torch.cuda.device_count())]
