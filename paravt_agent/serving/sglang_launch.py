"""Launch an SGLang server for a Qwen VL model (Qwen3-VL, Qwen2.5-VL, Qwen2-VL) and wait until it is healthy.

The server is told the frame sizes of the family it serves (``--mm-process-config``, read from the model directory's
processor: :func:`paravt_agent.policy.families.serve_settings`), so its image processor keeps the frames the client
sized with the model's unit: the same visual tokens on the client, the server and the trainer.

SGLang on GPUs needs the ``sglang`` extra (``pip install 'paravt[sglang]'``); ``device="cpu"`` runs SGLang's CPU
engine (``--device cpu``: the torch-native attention, float32, a bounded KV cache: :data:`CPU_FLAGS`), which the
test suite serves the toy policy with (``make sglang-cpu``). :func:`sglang_command` only builds the command, so
it is testable anywhere; ``python`` names the interpreter that has SGLang when it is not this one (the suite's
``.venv-sglang``).
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

from paravt_agent.errors import PolicyError
from paravt_agent.policy.families import cached_model_dir, geometry_of_dir, serve_settings

__all__ = ["CPU_ENV", "CPU_FLAGS", "HOOKS", "LORA_TARGET_MODULES", "WEIGHT_GROUP_TIMEOUT", "frame_settings", "launch",
           "lora_of_run", "sglang_command", "stop", "wait_healthy"]

#: the server's side of a weight-update group gives up a broadcast after this many seconds (torch's default: 30
#: minutes): a trainer host lost mid-bucket then blocks the server's scheduler this long, not half an hour
#: (sglang_hooks/sitecustomize.py, ``paravt serve --weight-group-timeout``)
WEIGHT_GROUP_TIMEOUT = 120.0
#: the folder put first on the server's ``PYTHONPATH``: its sitecustomize applies that timeout in every server process
HOOKS = Path(__file__).with_name("sglang_hooks")

#: 64-frame inputs need a larger multimodal cache (paper, Appendix B: ~134 MB per 64-frame video): a cache size
#: that is asked for is at least this.
MIN_VLM_CACHE_MB = 4096

#: the modules a LoRA run adapts by default (``paravt_train``'s ``LoraSettings.target_modules``: the language
#: model's projections; never ``embed_tokens`` / ``lm_head``, which SGLang's ``all`` adds)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: the modules SGLang 0.5.23 can serve adapters on (``SUPPORTED_LORA_TARGET_MODULES`` in ``sglang/srt/utils/common.py``)
SGLANG_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                                 "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj",
                                 "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud"})

#: the context length on GPUs (64 frames of 256 tokens need ~17K); on CPU the model's own
GPU_CONTEXT_LENGTH = 65536

#: SGLang's CPU engine (measured with 0.5.23 on x86 without AMX): the torch-native attention (the x86 default,
#: ``intel_amx``, needs AMX and SGLang's compiled CPU kernels), SDPA in the vision tower, torch's sampler, one
#: batch at a time (no overlap: pauses and weight updates act between steps), and an idle scheduler that sleeps
#: (otherwise it spins at 100% of a core).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--mm-attention-backend", "sdpa",
             "--sampling-backend", "pytorch", "--disable-overlap-schedule", "--sleep-on-idle"]
#: ``SGLANG_USE_CPU_ENGINE`` selects the CPU platform (without it the server dies importing vLLM's CUDA ops);
#: TorchDynamo off skips an inductor compile of the mRoPE at start-up (same logprobs, same decode speed)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1"}


def frame_settings(model: str) -> list[str]:
    """``--mm-process-config`` with the frame sizes of ``model``'s family (its directory's processor, or its snapshot in
    the Hugging Face cache: min one unit, max its own), so SGLang keeps the frames the client sized; none when its files
    are not on this machine (SGLang then keeps the checkpoint's own sizes, and SGLang 0.5.23 its own for Qwen2-VL)."""
    import json

    geometry = geometry_of_dir(cached_model_dir(model))
    if geometry is None:
        return []
    return ["--mm-process-config", json.dumps(serve_settings(geometry), separators=(",", ":"))]


def lora_of_run(path: str | Path) -> tuple[int, list[str]]:
    """``(rank, target modules)`` of the adapters a run trains, for the server it pushes them to: from a training
    config (its ``lora`` section: ``r``, ``target_modules``, the trainer's defaults where unset) or a peft adapter
    directory (``adapter_config.json``: ``r``, ``target_modules``)."""
    import json

    path = Path(path)
    if path.is_dir():
        f = path / "adapter_config.json"
        if not f.is_file():
            raise ValueError(f"{path} has no adapter_config.json: name a peft adapter directory or a training config")
        data = json.loads(f.read_text())
        modules = data.get("target_modules") or list(LORA_TARGET_MODULES)
        return int(data.get("r", 16)), [modules] if isinstance(modules, str) else list(modules)
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    lora = data.get("lora") or {}
    if not lora.get("enabled"):
        raise ValueError(f"{path} does not train LoRA adapters (lora.enabled is not true)")
    return int(lora.get("r", 16)), list(lora.get("target_modules") or LORA_TARGET_MODULES)


def lora_flags(rank: int | None, modules, cpu: bool, run: str | Path | None = None) -> list[str]:
    """SGLang's flags for serving adapters up to ``rank`` on exactly ``modules`` (what the trainer adapts;
    default :data:`LORA_TARGET_MODULES`), or both taken from ``run`` (:func:`lora_of_run`); none without a rank."""
    if run is not None:
        run_rank, run_modules = lora_of_run(run)
        if rank is not None and rank < run_rank:
            raise ValueError(f"lora_rank {rank} is below the rank {run_rank} of the adapters {run} trains")
        rank, modules = rank or run_rank, modules or run_modules
    if rank is None:
        return []
    modules = list(dict.fromkeys(modules or LORA_TARGET_MODULES))
    unsupported = [m for m in modules if m not in SGLANG_LORA_MODULES]
    if unsupported:
        raise ValueError(f"SGLang cannot serve LoRA adapters on {', '.join(unsupported)} (it supports "
                         f"{', '.join(sorted(SGLANG_LORA_MODULES))}): train the adapters on the language model's "
                         "projections only")
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules,
            "--max-loras-per-batch", "3", *(["--lora-backend", "torch_native"] if cpu else [])]


def sglang_command(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    tp: int = 1,
    mem_fraction: float | None = None,
    context_length: int | None = None,
    tool_call_parser: str = "qwen25",
    vlm_cache_mb: int | None = None,
    extra: list[str] | None = None,
    deterministic: bool = False,
    device: str = "cuda",
    dtype: str | None = None,
    max_total_tokens: int | None = None,
    python: str | None = None,
    lora_rank: int | None = None,
    lora_target_modules: list[str] | tuple[str, ...] | None = None,
    lora_from: str | Path | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    weight_group_timeout: float | None = WEIGHT_GROUP_TIMEOUT,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of ``python -m sglang.launch_server`` for a Qwen VL checkpoint, told its family's frame sizes
    (:func:`frame_settings`; an ``--mm-process-config`` in ``extra`` replaces them).

    ``api_key`` / ``admin_api_key``: SGLang's ``--api-key`` (every route but the health checks) and
    ``--admin-api-key`` (then the only key its admin routes take: pause, continue, weight updates, flush).
    ``weight_group_timeout``: seconds after which the server's side of a weight-update group gives up a broadcast
    (:data:`WEIGHT_GROUP_TIMEOUT`; None: torch's 30 minutes), through :data:`HOOKS` on its ``PYTHONPATH``.

    ``deterministic`` adds ``--enable-deterministic-inference``: SGLang honours a request's
    ``sampling_seed`` only then (the RL trainer seeds every rollout call; without it seeds are ignored
    and rollouts are not reproducible). SGLang 0.5.23 allows it only with GPU attention backends, so not
    with ``device="cpu"`` (a ValueError here rather than a server that exits).

    ``device="cpu"`` adds :data:`CPU_FLAGS` and :data:`CPU_ENV`, serves in ``dtype`` float32 unless told
    otherwise (``auto`` would serve a float32 checkpoint in float16 on CPU, so its logprobs would no longer be
    the float32 trainer's) and takes the model's own context length. ``max_total_tokens`` bounds the KV cache
    (SGLang otherwise takes ~70% of the free memory for it, which on CPU is the machine's RAM).

    ``vlm_cache_mb``: SGLang's vision-feature cache (``SGLANG_VLM_CACHE_SIZE_MB``). None leaves it to SGLang
    (100 MB in 0.5.23; off for Qwen3-VL on large Hopper GPUs); a size is raised to :data:`MIN_VLM_CACHE_MB`; 0
    turns it off, which a server an RL run trains the vision tower of needs: 0.5.23 keys the cache by the pixels
    and keeps it across weight updates (no flush clears it). Every server is started with
    ``SGLANG_EXPOSE_OWN_ENV_VARS=1``, so its ``/server_info`` lists the variables it was given (none: SGLang's
    default cache) and the trainer's syncs can warn about a server that keeps the cache.

    ``lora_rank`` serves LoRA adapters up to that rank (``sync.via: lora`` loads them by name) on
    ``lora_target_modules`` (default :data:`LORA_TARGET_MODULES`, the trainer's: never SGLang's ``all``, which
    adds ``embed_tokens`` and ``lm_head`` the trainer never adapts); ``lora_from`` (a training config or an adapter
    directory, :func:`lora_of_run`) derives both from the run. Three adapters per batch (the served adapter, a
    gate's candidate beside it, and the base model's requests); on CPU with SGLang's torch-native LoRA backend
    (the default one is triton). Long on purpose: one argument per SGLang setting, each said here."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: use cuda or cpu")
    cpu = device == "cpu"
    if deterministic and cpu:
        raise ValueError("SGLang's deterministic inference needs a GPU attention backend (fa3, flashinfer, triton): "
                         "on CPU request seeds are ignored")
    if context_length is None and not cpu:
        context_length = GPU_CONTEXT_LENGTH
    argv = [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", model, "--host", host, "--port", str(port), "--tp", str(tp),
        "--tool-call-parser", tool_call_parser, "--trust-remote-code",
    ]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    if cpu:
        argv += CPU_FLAGS
    if dtype is not None or cpu:
        argv += ["--dtype", dtype or "float32"]
    if max_total_tokens is not None:
        argv += ["--max-total-tokens", str(max_total_tokens)]
    if deterministic:
        argv.append("--enable-deterministic-inference")
    if mem_fraction is not None:
        argv += ["--mem-fraction-static", str(mem_fraction)]
    argv += lora_flags(lora_rank, lora_target_modules, cpu, run=lora_from)
    if api_key:
        argv += ["--api-key", api_key]
    if admin_api_key:
        argv += ["--admin-api-key", admin_api_key]
    if "--mm-process-config" not in (extra or []):
        argv += frame_settings(model)
    argv += list(extra or [])
    env = {"SGLANG_EXPOSE_OWN_ENV_VARS": "1", **(CPU_ENV if cpu else {})}
    if weight_group_timeout is not None:
        env["PARAVT_WEIGHT_GROUP_TIMEOUT"] = str(float(weight_group_timeout))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    if vlm_cache_mb is not None:
        env["SGLANG_VLM_CACHE_SIZE_MB"] = str(0 if vlm_cache_mb == 0 else max(vlm_cache_mb, MIN_VLM_CACHE_MB))
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


def launch(argv: list[str], env: dict[str, str], host: str, port: int, timeout: float = 900.0,
           log=None, wait: bool = True) -> subprocess.Popen:
    """Start the server and wait for health (``wait=False``: started only; :func:`wait_healthy` waits). Raises with
    install instructions when SGLang is missing. ``log``: a file the server's output goes to (default: this
    process's). The server leads its own process group (its scheduler and detokenizer are its children):
    :func:`stop` ends them all."""
    if argv[0] == sys.executable and importlib.util.find_spec("sglang") is None:
        if "--device" in argv and argv[argv.index("--device") + 1] == "cpu":  # the CPU engine: not the GPU extra
            raise PolicyError("SGLang is not installed in this Python: for its CPU engine run `make sglang-cpu` "
                              "(.venv-sglang, about a minute), then `paravt serve MODEL --device cpu --python "
                              ".venv-sglang/bin/python`")
        raise PolicyError("SGLang is not installed: `pip install 'paravt[sglang]'` (GPU), or name the Python that "
                          "has it with `paravt serve MODEL --python PYTHON`")
    if os.sep in argv[0] and not Path(argv[0]).exists():
        raise PolicyError(f"{argv[0]} does not exist: name the Python that has SGLang installed")
    out = {"stdout": log, "stderr": subprocess.STDOUT} if log is not None else {}
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, **out)
    if not wait:
        return proc
    try:
        wait_healthy(f"http://{host}:{port}", timeout=timeout, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 30.0, graceful: bool = True) -> None:
    """Stop a server started by :func:`launch` and every process of its group: SIGTERM (SGLang drains its requests
    and exits in ~5 s), SIGKILL after ``timeout``; at once with ``graceful=False``."""
    import signal

    def signal_group(sig) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_group(signal.SIGTERM if graceful else signal.SIGKILL)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        proc.wait(timeout)
    signal_group(signal.SIGKILL)  # children that outlived their leader
