"""SGLang 0.5.23's own server on CPU for the suite: ``.venv-sglang`` (``make sglang-cpu``), started with the launcher
``paravt serve`` runs (:func:`paravt_agent.serving.sglang_launch.sglang_command` with ``device="cpu"``).

A server takes 15-50 s to start on 2 cores and ~3.7 GB (RSS of its three processes), so the suite shares one per
model (``tests/conftest.py``: ``sglang_toy`` for the shipped toy policy, ``real_sglang`` for others) and
:meth:`SGLangServer.reset` puts the toy weights back between tests.
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["PYTHON", "SGLANG_VERSION", "SGLangServer", "rss_gb", "unavailable"]

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-sglang"
PYTHON = VENV / "bin" / "python"
SGLANG_VERSION = "0.5.23"

#: the suite's servers: a KV cache of 16K tokens (the toy model's 2 KB a token: 32 MB; SGLang would otherwise take
#: ~70% of the free RAM), no warm-up request (the fixture's first request is one)
SUITE_FLAGS = ["--skip-server-warmup", "--max-running-requests", "32", "--log-level", "warning"]
MAX_TOTAL_TOKENS = 16384


def unavailable() -> str | None:
    """Why the real server cannot run here (None when it can)."""
    if not (VENV / ".installed").is_file() or not PYTHON.exists():
        return f"SGLang's CPU engine is not installed ({VENV.name} missing: `make sglang-cpu`)"
    return None


class SGLangServer:
    """One SGLang server (``python -m sglang.launch_server --device cpu``) on 127.0.0.1, its log in ``log``.
    The same surface as the stand-in (``url``, ``proc``, :meth:`post`, :meth:`close`)."""

    def __init__(self, model: str, log_dir: Path, port: int | None = None, extra: list[str] | None = None,
                 max_total_tokens: int = MAX_TOTAL_TOKENS, timeout: float = 240.0, lora_rank: int | None = None):
        from paravt_agent.serving.sglang_launch import launch, sglang_command
        from tests.conftest import free_port

        self.model = model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # no vision-feature cache: the suite pushes trained vision towers, and SGLang 0.5.23 keeps cached features
        # across weight updates (the RL tests' image turns then mismatched by up to 0.02 a token after a push)
        argv, env = sglang_command(model, "127.0.0.1", self.port, device="cpu", python=str(PYTHON),
                                   max_total_tokens=max_total_tokens, extra=[*SUITE_FLAGS, *(extra or [])],
                                   vlm_cache_mb=0, lora_rank=lora_rank)
        # one thread: the toy model is tiny, and the trainer in the same test shares the two cores
        env = {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false"}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"sglang-{self.port}.log"
        self.started = time.monotonic()
        with self.log.open("w") as f:
            try:
                self.proc = launch(argv, env, "127.0.0.1", self.port, timeout=timeout, log=f)
            except Exception as exc:
                raise RuntimeError(f"SGLang did not start ({exc}): {self.tail()}") from exc
        self.start_seconds = time.monotonic() - self.started

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=timeout)
        return r.json()

    def get(self, path: str, timeout: float = 60):
        import httpx

        return httpx.get(self.url + path, timeout=timeout)

    def reset(self, model_dir: str | None = None, version: str = "default") -> None:
        """Back to a served model's launch state: generation running, no weight-update session or group left
        open, ``model_dir``'s weights (default: the launch model) as ``version``, the cache flushed (waiting
        up to 60 s for running requests to finish)."""
        import httpx

        with httpx.Client(timeout=120) as c:
            c.post(self.url + "/continue_generation", json={})
            c.post(self.url + "/end_weight_update", json={})  # 400 when none is open
            c.post(self.url + "/destroy_weights_update_group", json={"group_name": "paravt_weight_sync"})
            r = c.post(self.url + "/update_weights_from_disk", json={
                "model_path": str(model_dir or self.model), "weight_version": version, "flush_cache": False})
            if r.status_code != 200 or not r.json().get("success"):
                raise RuntimeError(f"{self.url} could not reload {model_dir or self.model}: {r.text[:300]}")
            r = c.post(self.url + "/flush_cache", params={"timeout": 60})
            if r.status_code != 200:
                raise RuntimeError(f"{self.url} did not flush its cache: {r.text[:300]}")

    def close(self) -> None:
        from paravt_agent.serving.sglang_launch import stop

        stop(self.proc, graceful=False)  # a test server: no drain; the whole group (a scheduler can outlive a leader)


def rss_gb(pid: int) -> float:
    """Resident memory of a process and its descendants, in GB (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(x) for x in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1e6


