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

from paravt_agent.errors import PolicyError

__all__ = ["sglang_command", "wait_healthy", "launch"]

#: 64-frame inputs need a larger multimodal cache (paper, Appendix B: ~134 MB per 64-frame video).
MIN_VLM_CACHE_MB = 4096


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
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of ``python -m sglang.launch_server`` for a Qwen3-VL checkpoint."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model, "--host", host, "--port", str(port),
        "--tp", str(tp), "--context-length", str(context_length),
        "--tool-call-parser", tool_call_parser, "--trust-remote-code",
    ]
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
