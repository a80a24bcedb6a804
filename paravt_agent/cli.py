"""The ``paravt`` command: answer questions about videos, serve a model, list tools.

Lazy imports: each command imports the modules it runs inside its own body, so `paravt --help` and every other
command stay instant (torch, transformers and the servers load only for the command that needs them).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

app = typer.Typer(
    help="ParaVT: parallel video tool calling for long-video question answering.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help layout: typer's rich panels show a flag as `--json <bool>`
)


@app.callback()
def main() -> None:
    """ParaVT: parallel video tool calling for long-video question answering."""


@app.command("tools")
def tools_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the OpenAI-style function schemas as JSON."),
) -> None:
    """List the available tools (built-ins and `paravt.tools` entry-point plugins) with their schemas."""
    from paravt_agent.plugins import toolset

    reg = toolset()(None)  # the default set, by its entry point (paravt_agent never imports the tools package)
    if as_json:
        typer.echo(json.dumps(reg.schemas(), indent=2))
        return
    for tool in reg:
        params = tool.schema()["function"]["parameters"]
        required = set(params["required"])
        args = ", ".join(
            f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
            for name, spec in params["properties"].items()
        )
        kind = ("visual, frames to the planner" if tool.evidence == "frames" else
                "visual, summarised by a sub-agent" if tool.visual else "text")
        if tool.uses_model:
            kind += "; asks a model (tool:" + tool.name + ")"
        typer.echo(f"{tool.name}({args})  [{kind}]\n    {tool.description}")


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


def _build_agent(backend: str, model: str | None, endpoint: str | None, mode: str | None, preset: str | None,
                 config: Path | None, set_: list[str] | None, store=None, api_key: str | None = None):
    """One rule for every entry point: --config, else --preset, else the model's agent_config.yaml, else
    defaults (the local backend's default model: the shipped toy policy)."""
    from paravt_agent.agent import Agent
    from paravt_agent.config import resolve_agent_config
    from paravt_agent.defaults import resolve_model

    model = resolve_model(backend, model)
    overrides = list(set_ or []) + ([f"mode={mode}"] if mode else [])
    notes: list[str] = []
    cfg = resolve_agent_config(config, model if backend != "openai" else None, overrides, preset=preset, notes=notes)
    for note in notes:
        typer.echo(note, err=True)
    from paravt_agent.telemetry import configure_from_env

    configure_from_env()  # OTEL_TRACES_EXPORTER=otlp|console: one trace per question
    return Agent(model=model, backend=backend, endpoint=endpoint, config=cfg, store=store, api_key=api_key)


@app.command("answer")
def answer_cmd(
    video: str = typer.Argument(..., help="The video: a local file or an http(s) URL (downloaded once)."),
    question: str = typer.Argument(..., help="The question about the video."),
    options: list[str] = typer.Option(None, "--options", "-o", help="An MCQ option; repeat for each (A, B, ...)."),
    backend: str = typer.Option("local", help="local (a model directory), openai (any endpoint) or sglang."),
    model: str = typer.Option(None, help="Model directory (local/sglang) or served model name (openai)."),
    endpoint: str = typer.Option(None, help="Endpoint URL for openai/sglang (default http://127.0.0.1:30000/v1)."),
    mode: str = typer.Option(None, help="Dispatch mode: parallel, sequential, none or collaborative."),
    n_frames: int = typer.Option(None, "--n-frames", help="Exactly this many overview frames."),
    preset: str = typer.Option(None, help="Protocol preset: paravt, paravt-rl, paravt-eval, longvt (default: the "
                                          "model directory's own, else paravt)."),
    config: Path = typer.Option(None, help="AgentConfig YAML file."),
    set_: list[str] = typer.Option(None, "--set", help="Config override key=value, e.g. --set max_turns=2."),
    allow_url_prefix: list[str] = typer.Option(None, "--allow-url-prefix", help="A video URL under this prefix is "
                                               "fetched even from a loopback, private or link-local address (refused "
                                               "by default; repeatable; env PARAVT_ALLOW_URL_PREFIXES adds more)."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole trace as JSON, with its status (ok, "
                                 "degraded, failed), the tool calls that failed and what to change."),
    profile: bool = typer.Option(False, "--profile", help="Also print where the time went: overview decode, "
                                 "planner prefill/decode, each sub-agent's crop decode and generation, "
                                 "aggregation, the answer turn."),
) -> None:
    """Answer a question about a video and print the answer with a compact trace."""
    import os

    from paravt_agent.errors import ParaVTError
    from paravt_agent.video.fetch import ALLOW_ENV, allowed_prefixes, check_url, is_url
    from paravt_agent.video.sniff import refuse_not_video

    if allow_url_prefix:  # the fetch reads the operator's prefixes from the environment (SDK, CLI alike)
        os.environ[ALLOW_ENV] = " ".join(allowed_prefixes(allow_url_prefix))
    try:
        agent = _build_agent(backend, model, endpoint, mode, preset, config, set_)
        # every check that needs no model, before any model work: the question and options, the URL policy, the file
        agent.check_input(question, options or None)
        if is_url(video):
            check_url(video, allowed_prefixes())
        elif os.path.isfile(video):
            refuse_not_video(video)
        ans = agent.answer(video, question, options or None, n_frames=n_frames)
    except ParaVTError as exc:
        _fail(str(exc))
    trace = ans.trace
    if as_json:
        out = {"status": trace.status, "ok": trace.ok, "failed_calls": trace.runtime_call_errors,
               "advice": trace.advice, **json.loads(trace.to_json())}
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(trace.render())
    if profile:
        typer.echo(("\n" if not as_json else "") + trace.render_profile(), err=as_json)
    if trace.errors and not trace.turns:
        raise typer.Exit(1)
    if ans.status == "degraded":  # answered, but from the error slots of calls that could not run
        typer.echo(f"warning: degraded answer: {trace.failed_calls} tool call(s) failed in the runtime (see Errors "
                   "above); exit status 3", err=True)
        for line in trace.advice:
            typer.echo(f"  to change: {line}", err=True)
        raise typer.Exit(3)


@app.command("api")
def api_cmd(
    model: str = typer.Option(None, help="Model directory (local/sglang; default: the shipped toy policy) or the "
                                         "served model name behind --endpoint (openai)."),
    backend: str = typer.Option("local", help="local (in-process transformers), openai (any endpoint) or sglang."),
    endpoint: str = typer.Option(None, help="The model server for openai/sglang (an sglang-router URL spreads the "
                                            "agent's calls over its workers)."),
    host: str = typer.Option("127.0.0.1", help="Bind address (expose it with --api-key)."),
    port: int = typer.Option(8000, help="Port."),
    video_root: Path = typer.Option(None, "--video-root", help="Videos named by path must lie under this folder "
                                    "(without it only http(s) URLs are accepted)."),
    store: str = typer.Option(None, help="Trajectory store for every trace and POST /v1/feedback: a SQLite path "
                                         "or postgresql://user:pass@host/db."),
    api_key: str = typer.Option(None, "--api-key", envvar="PARAVT_API_KEY", help="Require "
                                "'Authorization: Bearer KEY' (env PARAVT_API_KEY); without --keys everyone holding it "
                                "is one principal (one voter for the online learner)."),
    keys: str = typer.Option(None, "--keys", help="Map API keys to principals (each key's owner is one voter for "
                             "the online learner; a request's `user` is a sub-label within it): a YAML file "
                             "(`alice: KEY`, a list of keys, or `sha256:DIGEST`; read again when it changes) or "
                             "`store` (the keys `paravt keys add NAME --store ...` made). Any key it maps is "
                             "accepted."),
    served_model_name: str = typer.Option("paravt", help="The model name clients send and /v1/models lists."),
    max_concurrent: int = typer.Option(32, min=1, help="Questions answered at once (their model calls batch)."),
    max_queue: int = typer.Option(64, min=0, help="Questions waiting beyond those; more get 429 + Retry-After."),
    max_request_kb: int = typer.Option(1024, min=1, help="Largest request body."),
    max_download_mb: int = typer.Option(2048, min=1, help="Largest http(s) video a request may name."),
    download_timeout: float = typer.Option(300.0, help="Seconds a video download may take."),
    allow_url_prefix: list[str] = typer.Option(None, "--allow-url-prefix", help="Video URLs under this prefix are "
                                               "fetched even from loopback, private or link-local addresses (refused "
                                               "by default; repeatable; env PARAVT_ALLOW_URL_PREFIXES adds more)."),
    mode: str = typer.Option(None, help="Default dispatch mode (requests may set `mode`)."),
    preset: str = typer.Option(None, help="Protocol preset (default: the model directory's own, else paravt)."),
    config: Path = typer.Option(None, help="AgentConfig YAML file."),
    set_: list[str] = typer.Option(None, "--set", help="Config override key=value."),
    upstream_key: str = typer.Option(None, "--upstream-key", envvar="OPENAI_API_KEY",
                                     help="API key of the model server behind --endpoint."),
    degraded: str = typer.Option("answer", help="An answer built on tool calls that failed in the runtime "
                                 "(timeouts, endpoint errors): 'answer' (200, paravt.status 'degraded', paravt.ok "
                                 "false, the failures in paravt.errors) or 'error' (502 degraded_answer)."),
) -> None:
    """Serve the whole agent as an OpenAI-compatible endpoint: /v1/chat/completions (plain and streaming),
    /v1/models and /v1/feedback. A user message holds the question and the video as a video_url part.

    OpenTelemetry traces (one per question) go to the exporter OTEL_TRACES_EXPORTER names (otlp, console)."""
    from paravt_agent.errors import ParaVTError
    from paravt_agent.serving.api import ApiSettings, serve
    from paravt_agent.store import open_store

    if video_root is not None and not video_root.is_dir():
        _fail(f"--video-root {video_root}: no such folder")
    if degraded not in ("answer", "error"):
        _fail(f"--degraded {degraded!r}: use 'answer' or 'error'")
    try:
        agent = _build_agent(backend, model, endpoint, mode, preset, config, set_, store=open_store(store),
                             api_key=upstream_key)
    except ParaVTError as exc:
        _fail(str(exc))
    settings = ApiSettings(model_name=served_model_name, video_root=str(video_root) if video_root else None,
                           api_key=api_key, keys=keys, max_concurrent=max_concurrent, max_queue=max_queue,
                           max_request_bytes=max_request_kb << 10, max_download_bytes=max_download_mb << 20,
                           download_timeout=download_timeout, allow_url_prefixes=tuple(allow_url_prefix or ()),
                           degraded=degraded)
    typer.echo(f"ParaVT agent API on http://{host}:{port}/v1 (model {served_model_name!r}, "
               f"{agent.policy.name} backend)", err=True)
    try:
        serve(agent, settings, host=host, port=port)
    except ParaVTError as exc:  # a keys file that cannot be read, --keys store without --store
        _fail(str(exc))


keys_app = typer.Typer(help="API keys mapped to principals in the trajectory store (`paravt api --keys store`): "
                            "each principal is one voter for the online learner.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
STORE_HELP = "The trajectory store that holds the keys: a SQLite path or postgresql://user:pass@host/db."


@keys_app.command("add")
def keys_add(name: str = typer.Argument(..., help="The principal (letters, digits, _.@+-)."),
             store: str = typer.Option(..., help=STORE_HELP)) -> None:
    """Make a new key for NAME and print it (only its SHA-256 is kept: this is the one time it is shown)."""
    from paravt_agent.store import open_store

    try:
        typer.echo(open_store(store).add_key(name))
    except ValueError as exc:
        _fail(str(exc))


@keys_app.command("list")
def keys_list(store: str = typer.Option(..., help=STORE_HELP)) -> None:
    """Every key: its principal, the start of its SHA-256, when it was made."""
    import time

    from paravt_agent.store import open_store

    for k in open_store(store).api_keys():
        typer.echo(f"key:{k['principal']}\tsha256:{k['digest']}...\t"
                   f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(k['created']))}")


@keys_app.command("revoke")
def keys_revoke(name: str = typer.Argument(..., help="The principal whose keys stop working."),
                store: str = typer.Option(..., help=STORE_HELP)) -> None:
    """Delete every key of NAME (a running `paravt api --keys store` refuses them within 5 s)."""
    from paravt_agent.store import open_store

    n = open_store(store).revoke_keys(name)
    typer.echo(f"{n} key{'s' if n != 1 else ''} of {name} revoked")
    if not n:
        raise typer.Exit(1)


@app.command("serve", help="Serve a model with SGLang (GPU, or --device cpu); continue generation a dead weight "
                            "pusher left paused.")
def serve_cmd(
    model: str = typer.Argument(..., help="Model directory (or hub name) of a Qwen3-VL, Qwen2.5-VL or Qwen2-VL "
                                          "checkpoint; a directory's frame sizes (its family's unit and pixel "
                                          "bounds) are given to SGLang, so it keeps the frames clients size."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(30000, help="Port."),
    tp: int = typer.Option(1, help="Tensor-parallel GPUs (per worker with --dp)."),
    dp: int = typer.Option(1, min=1, help="Data-parallel workers: N SGLang servers (ports PORT+1..PORT+N, TP GPUs "
                                          "each) behind sglang-router on PORT, which spreads requests (cache-aware) "
                                          "and retries on another worker when one fails."),
    mem_fraction: float = typer.Option(None, help="--mem-fraction-static for SGLang."),
    context_length: int = typer.Option(None, help="Context length (default 65536 on GPUs: 64 frames of 256 tokens "
                                                  "need ~17K; on CPU the model's own)."),
    device: str = typer.Option("cuda", help="cuda, or cpu: SGLang's CPU engine (the torch-native attention, "
                                            "float32; it needs SGLang's CPU kernels, or the test suite's "
                                            "`make sglang-cpu`)."),
    max_total_tokens: int = typer.Option(None, help="--max-total-tokens: the KV cache's size in tokens (SGLang "
                                                    "otherwise takes ~70% of the free memory, on CPU the RAM's)."),
    python: str = typer.Option(None, help="The Python that has SGLang installed (default: this one; e.g. "
                                          ".venv-sglang/bin/python)."),
    vlm_cache_mb: int = typer.Option(None, help="SGLANG_VLM_CACHE_SIZE_MB (unset: SGLang's own choice; a size is "
                                                "raised to 4096, what 64-frame inputs need); 0 turns the "
                                                "vision-feature cache off, which a server an RL run pushes a trained "
                                                "vision tower to needs (SGLang keeps the cached features across "
                                                "weight updates)."),
    deterministic: bool = typer.Option(False, "--deterministic", help="--enable-deterministic-inference: honour "
                                       "each request's sampling seed (reproducible RL rollouts); without it SGLang "
                                       "ignores seeds."),
    max_pixels: int = typer.Option(None, hidden=True, help="Deprecated: the frame sizes are read from the model."),
    lora_rank: int = typer.Option(None, min=1, help="Serve LoRA adapters up to this rank (--enable-lora on the "
                                  "trainer's default modules): what a `lora.enabled` run with `sync.via: lora` "
                                  "pushes. On CPU, SGLang "
                                  "0.5.23's LoRA needs the test suite's CPU module (`make sglang-cpu`)."),
    lora_from: Path = typer.Option(None, help="A training config (its `lora` section) or a peft adapter directory: "
                                   "serve LoRA adapters with that run's rank and target modules."),
    pause_lease: float = typer.Option(60.0, min=0, help="Continue generation on a server paused this long past the "
                                      "--sync-lease file's last renewal, as this process's clock sees it (a dead "
                                      "pusher); 0: never."),
    sync_lease: Path = typer.Option(None, help="The learner's push journal (OUTPUT_DIR/push.json): its lease."),
    max_pause: float = typer.Option(600.0, min=0, help="Continue generation on a server paused this long, lease or "
                                    "not (a hung pusher; without --sync-lease the only bound: set it above the "
                                    "longest push); 0: no cap."),
    worker_host: str = typer.Option(None, help="With --dp: the address the workers listen on and are registered "
                                    "with the router under, which other hosts reach (default: --host, or this "
                                    "machine's address when --host is a wildcard): a trainer on another host pushes "
                                    "its weights to each worker the router lists."),
    api_key: str = typer.Option(None, envvar="PARAVT_SGLANG_API_KEY", help="SGLang's --api-key (every route but "
                                "the health checks; the router's too); default from $PARAVT_SGLANG_API_KEY."),
    admin_api_key: str = typer.Option(None, envvar="PARAVT_SGLANG_ADMIN_API_KEY", help="SGLang's --admin-api-key "
                                      "(then the only key its admin routes take: pause, continue, weight updates, "
                                      "flush); default from $PARAVT_SGLANG_ADMIN_API_KEY."),
    weight_group_timeout: float = typer.Option(120.0, min=0, help="Seconds after which the server gives up a weight "
                                               "broadcast a trainer never finishes (a trainer host lost mid-bucket): "
                                               "its scheduler goes on and users are answered again (torch's default "
                                               "is 30 minutes); 0: torch's default."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command and exit."),
) -> None:
    """`paravt serve` (its help is the decorator's). Long by design: typer reads the command's options from this
    signature; a note for developers, kept out of `--help`."""
    from paravt_agent.errors import ParaVTError
    from paravt_agent.policy.families import cached_model_dir, geometry_of_dir
    from paravt_agent.serving.sglang_launch import launch, sglang_command, stop

    if max_pixels is not None:
        from paravt_agent.compat import REMOVED_IN  # loaded by the one command that warns with it

        typer.echo(f"warning: --max-pixels is no longer a setting and is ignored (the frame sizes are read from the "
                   f"model's processor); delete it (refused from {REMOVED_IN})", err=True)
    served = model
    geometry = geometry_of_dir(cached_model_dir(model))
    if geometry is not None:
        typer.echo(f"frames: {geometry.describe()}; SGLang keeps images of {geometry.unit}x{geometry.unit} to "
                   f"{geometry.max_pixels} pixels as they come (the frames clients size)", err=True)
    else:
        typer.echo(f"frames: {model}'s processor is not on this machine, so its frame sizes cannot be read and SGLang "
                   "keeps the checkpoint's own (a client's frames may then be resized: download the model first)",
                   err=True)
    kw = dict(mem_fraction=mem_fraction, context_length=context_length, vlm_cache_mb=vlm_cache_mb,
              deterministic=deterministic, device=device, max_total_tokens=max_total_tokens, python=python,
              lora_rank=lora_rank, lora_from=lora_from, api_key=api_key, admin_api_key=admin_api_key,
              weight_group_timeout=weight_group_timeout or None)
    if dp > 1:
        from paravt_agent.serving.fleet import launch_router, router_commands

        try:
            workers, router = router_commands(served, dp, host, port, tp, worker_host=worker_host, **kw)
        except ValueError as exc:
            _fail(str(exc))
        lines = [" ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(_hide_keys(argv))
                 for argv, env in workers]
        lines.append(shlex.join(_hide_keys(router)))
        start, what = (lambda: launch_router(workers, router, host, port)), f" ({dp} workers behind sglang-router"
    else:
        try:
            argv, env = sglang_command(served, host, port, tp, **kw)
        except ValueError as exc:
            _fail(str(exc))
        lines = [" ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(_hide_keys(argv))]
        start, what = (lambda: [launch(argv, env, host, port)]), " ("
    if dry_run:
        typer.echo("\n".join(lines))
        return
    typer.echo("starting:\n  " + "\n  ".join(lines), err=True)
    try:
        procs = start()
    except ParaVTError as exc:
        _fail(str(exc))
    if device == "cuda":  # which GPUs it was given, by UUID: a trainer's tensor sync on this machine reads it
        from paravt_agent.serving.fleet import record_gpus, visible_gpu_uuids

        uuids = visible_gpu_uuids()
        for proc, p in zip(procs, [port + 1 + i for i in range(dp)] if dp > 1 else [port], strict=False):
            record_gpus(p, proc.pid, uuids)
    typer.echo(f"healthy: http://{host}:{port}/v1{what}{'; ' if dp > 1 else ''}Ctrl-C to stop)", err=True)
    keys = {"api_key": api_key, "admin_key": admin_api_key, "worker_host": worker_host}
    sys.exit(_wait_then_stop(procs, stop, (host, port, dp, pause_lease, sync_lease, max_pause), keys))


def _hide_keys(argv: list[str]) -> list[str]:
    """A command as printed: the values of ``--api-key`` / ``--admin-api-key`` hidden."""
    return [("***" if i and argv[i - 1] in ("--api-key", "--admin-api-key") else a) for i, a in enumerate(argv)]


def _wait_then_stop(procs: list, stop, supervised: tuple | None = None, keys: dict | None = None) -> int:
    """Wait on the last server process (the router, or the one server); Ctrl-C or a scheduler's SIGTERM stops
    every server (each leads its own process group). Returns the exit code. Meanwhile the pause supervisor of
    ``supervised`` (host, port, dp, --pause-lease, --sync-lease, --max-pause) runs."""
    import signal

    from paravt_agent.serving.supervisor import supervise  # httpx and threads: only `serve` pays for them

    supervisor = (supervise(*supervised, log=lambda m: typer.echo(m, err=True), **(keys or {})) if supervised
                  else None)

    def interrupted(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        code = procs[-1].wait()
    except KeyboardInterrupt:
        code = 0
    if supervisor is not None:
        supervisor.stop()
    for p in reversed(procs):
        stop(p)
    return code


if __name__ == "__main__":
    app()
