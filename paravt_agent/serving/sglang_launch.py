"""Launch an SGLang server for Qwen3-VL serving and wait until it is healthy.

SGLang needs a GPU and the ``sglang`` extra (``pip install 'paravt[sglang]'``);
:func:`sglang_command` only builds the command, so it is testable anywhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from paravt_agent.defaults import paravt_home
from paravt_agent.errors import PolicyError

__all__ = ["launch", "launch_router", "protocol_model_dir", "router_commands", "sglang_command", "wait_healthy"]

#: 64-frame inputs need a larger multimodal cache (paper, Appendix B: ~134 MB per 64-frame video).
MIN_VLM_CACHE_MB = 4096


def _processor_files(model_dir: Path) -> list[Path]:
    return [p for p in (model_dir / "preprocessor_config.json", model_dir / "processor_config.json") if p.is_file()]


def _image_sections(data: dict) -> list[dict]:
    """The image-processor settings in a processor config (top level, or under ``image_processor``)."""
    out = [data] if "image_processor_type" in data or "size" in data or "min_pixels" in data else []
    if isinstance(data.get("image_processor"), dict):
        out.append(data["image_processor"])
    return out


def _min_pixels(section: dict) -> int | None:
    size = section.get("size") or {}
    values = [v for v in (section.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")) if v]
    return max(values) if values else None


def protocol_model_dir(model: str, max_pixels: int = 50176, factor: int = 32, cache: str | Path | None = None) -> str:
    """A model directory whose image processor keeps the frame protocol's sizes.

    Qwen3-VL's processor upscales every image to at least ``min_pixels`` (65536): a 224x224 protocol
    frame would reach the model as 256x256, a third more visual tokens than the client (and the
    trainer) count. When ``model`` is a local directory with such a setting, this returns an overlay
    directory (every file linked, the processor configs rewritten with ``min_pixels`` = one patch
    grid, ``factor``²) that SGLang serves instead; otherwise ``model`` itself.
    """
    import hashlib
    import json

    src = Path(model)
    if not src.is_dir():
        return model
    files = _processor_files(src)
    fixes = {}
    for f in files:
        data = json.loads(f.read_text())
        changed = False
        for section in _image_sections(data):
            low = _min_pixels(section)
            if low is not None and low > factor * factor:
                if "min_pixels" in section:
                    section["min_pixels"] = factor * factor
                size = section.get("size")
                if isinstance(size, dict):
                    for key in ("shortest_edge", "min_pixels"):
                        if key in size:
                            size[key] = factor * factor
                changed = True
        if changed:
            fixes[f.name] = data
    if not fixes:
        return model

    key = hashlib.sha256(f"{src.resolve()}:{sorted(fixes)}:{factor}".encode()).hexdigest()[:12]
    out = Path(cache or paravt_home() / "serve") / f"{src.name}-protocol-{key}"
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = out / item.name
        if item.name in fixes or target.exists() or target.is_symlink():
            continue
        target.symlink_to(item.resolve())
    for name, data in fixes.items():
        (out / name).write_text(json.dumps(data, indent=2))
    return str(out)


def sglang_command(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    tp: int = 1,
    mem_fraction: float | None = None,
    context_length: int = 65536,
    tool_call_parser: str = "qwen25",
    vlm_cache_mb: int = MIN_VLM_CACHE_MB,
    extra: list[str] | None = None,
    deterministic: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of ``python -m sglang.launch_server`` for a Qwen3-VL checkpoint.

    ``deterministic`` adds ``--enable-deterministic-inference``: SGLang honours a request's
    ``sampling_seed`` only then (the RL trainer seeds every rollout call; without it seeds are ignored
    and rollouts are not reproducible)."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model, "--host", host, "--port", str(port),
        "--tp", str(tp), "--context-length", str(context_length),
        "--tool-call-parser", tool_call_parser, "--trust-remote-code",
    ]
    if deterministic:
        argv.append("--enable-deterministic-inference")
    if mem_fraction is not None:
        argv += ["--mem-fraction-static", str(mem_fraction)]
    argv += list(extra or [])
    env = {"SGLANG_VLM_CACHE_SIZE_MB": str(max(vlm_cache_mb, MIN_VLM_CACHE_MB))}
    return argv, env


def wait_healthy(url: str, timeout: float = 900.0, proc: subprocess.Popen | None = None, interval: float = 2.0) -> None:
    """Poll ``{url}/health`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise PolicyError(f"the server exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval)
    raise PolicyError(f"{url} did not become healthy within {timeout:.0f}s")


def launch(argv: list[str], env: dict[str, str], host: str, port: int, timeout: float = 900.0) -> subprocess.Popen:
    """Start the server and wait for health. Raises with install instructions when SGLang is missing."""
    if importlib.util.find_spec("sglang") is None:
        raise PolicyError("SGLang is not installed: `pip install 'paravt[sglang]'` (needs a CUDA GPU)")
    proc = subprocess.Popen(argv, env={**os.environ, **env})
    try:
        wait_healthy(f"http://{host}:{port}", timeout=timeout, proc=proc)
    except BaseException:
        proc.terminate()
        raise
    return proc


def router_commands(
    model: str, dp: int, host: str = "127.0.0.1", port: int = 30000, tp: int = 1, policy: str = "cache_aware",
    **worker_kw,
) -> tuple[list[tuple[list[str], dict[str, str]]], list[str]]:
    """``dp`` SGLang workers (ports ``port+1 … port+dp``, ``tp`` GPUs each from ``--base-gpu-id``) and the
    ``sglang-router`` in front of them on ``port``: ``([(worker argv, env), ...], router argv)``.

    Workers listen on 127.0.0.1 (only the router faces clients). ``cache_aware`` routing sends requests
    that share a prefix (a question's G rollouts, a planner's later turns) to the worker that holds it
    in its radix cache."""
    if dp < 1:
        raise ValueError("dp must be at least 1")
    workers, urls = [], []
    for i in range(dp):
        wport = port + 1 + i
        argv, env = sglang_command(model, "127.0.0.1", wport, tp, **worker_kw)
        workers.append((argv + ["--base-gpu-id", str(i * tp)], env))
        urls.append(f"http://127.0.0.1:{wport}")
    router = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
              "--policy", policy, "--worker-urls", *urls]
    return workers, router


def launch_router(workers: list[tuple[list[str], dict[str, str]]], router: list[str], host: str, port: int,
                  timeout: float = 900.0) -> list[subprocess.Popen]:
    """Start the workers, wait until each is healthy, then the router; every process is stopped if any fails."""
    if importlib.util.find_spec("sglang_router") is None:
        raise PolicyError("sglang-router is not installed: `pip install sglang-router` (or 'paravt[sglang]')")
    procs: list[subprocess.Popen] = []
    try:
        for argv, env in workers:
            procs.append(launch(argv, env, "127.0.0.1", int(argv[argv.index("--port") + 1]), timeout=timeout))
        proc = subprocess.Popen(router)
        procs.append(proc)
        wait_healthy(f"http://{host}:{port}", timeout=120, proc=proc)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    return procs
