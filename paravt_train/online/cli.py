"""``paravt-train online``: run the online learner, and look after the versions it serves.

    paravt-train online --store S --config C          learn from feedback (until interrupted)
    paravt-train online status   --config C           the served version, the candidate, the last gate, the queue,
                                                      rows skipped and why, per-user counts
    paravt-train online versions --config C           every version: status, gate scores, feedback trained into it
    paravt-train online promote V --config C          put version V on the server (pause → update → continue)
    paravt-train online rollback [V] --config C       put back V (default: the newest version served before this
                                                      one that no rollback took back)

A running learner follows a promote or rollback (it continues from the version that serves).

Lazy imports: each command imports the modules it runs inside its own body, so `paravt-train online --help` and
every other command stay instant (torch, transformers and the servers load only for the command that needs them).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Online learning from user feedback, gated versions, promote and rollback.",
                  add_completion=False, invoke_without_command=True,
                  rich_markup_mode=None)  # click's help layout (paravt_agent.cli says why)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


def _config(config: Path, set_: list[str] | None):
    from paravt_agent.errors import ConfigError
    from paravt_train.online.config import OnlineConfig

    try:
        return OnlineConfig.from_yaml(config, list(set_ or []))
    except ConfigError as exc:
        _fail(str(exc))


def _registry(cfg):
    from paravt_train.online.versions import VersionRegistry

    return VersionRegistry(Path(cfg.output_dir) / "versions")


@app.callback()
def run(
    ctx: typer.Context,
    store: str = typer.Option(None, help="Trajectory store the serving agent writes to: a SQLite path "
                                         "(sqlite:///PATH) or postgresql://user:pass@host/db."),
    config: Path = typer.Option(None, "--config", help="The learner's config YAML: a GRPO config and `online:` "
                                                       "(model, output_dir, backend, online, ...)."),
    endpoint: str = typer.Option(None, help="SGLang server to push promoted versions to (sets backend sglang)."),
    set_: list[str] = typer.Option(None, "--set", help="Override key=value of the GRPO config."),
    poll: float = typer.Option(30.0, help="Seconds between looks at the store when there is nothing to train."),
    max_steps: int = typer.Option(None, help="Stop after this many updates (default: run until interrupted)."),
    once: bool = typer.Option(False, "--once", help="Train on what is there now, then exit."),
) -> None:
    """Learn from user feedback: feedback with a correct answer becomes RL prompts (each row checked; one user's
    rows limited); every `online.promote_every` updates the candidate is gated on a pinned evaluation set
    (`online.gate`) and promoted to the server or kept aside; the served version's live score (the gate's metric
    on users' labels) can roll it back. Progress is checkpointed: a restart neither loses nor re-trains feedback."""
    ctx.ensure_object(dict).update(config=config, set_=set_)
    if ctx.invoked_subcommand is not None:
        return
    if store is None or config is None:
        _fail("the learner needs --store and --config (or a subcommand: status, versions, promote, rollback)")
    from paravt_agent.errors import ConfigError
    from paravt_train.infra.distributed import end_process, shutdown_distributed
    from paravt_train.infra.interrupt import EXIT_CODE
    from paravt_train.online.learner import OnlineLearner

    overrides = list(set_ or [])
    if endpoint:
        overrides += ["backend=sglang", f"endpoint={endpoint}"]
    cfg = _config(config, overrides)
    try:
        learner = OnlineLearner(cfg, store)
        n = learner.run(poll=poll, max_steps=max_steps, once=once)
    except ConfigError as exc:
        _fail(str(exc))
    finally:
        shutdown_distributed()
    typer.echo(f"{n} updates; {learner.consumed} feedback rows consumed; checkpoints in {cfg.output_dir}")
    end_process(EXIT_CODE if learner.stopped else 0)  # a torchrun worker ends here (infra.distributed)
    if learner.stopped:
        raise typer.Exit(EXIT_CODE)


def _opts(ctx: typer.Context, config: Path | None):
    config = config or ctx.obj.get("config")
    if config is None:
        _fail("give --config (the learner's config YAML: its output_dir holds the versions)")
    return _config(config, ctx.obj.get("set_"))


@app.command("status")
def status(ctx: typer.Context, config: Path = typer.Option(None, "--config", help="The learner's config YAML."),
           as_json: bool = typer.Option(False, "--json", help="Print it as JSON.")) -> None:
    """The served version, the newest candidate, the last gate, the queue, rows skipped and why, per-user counts."""
    from paravt_train.online.promotion import live_counts

    cfg = _opts(ctx, config)
    reg = _registry(cfg)
    state_file = Path(cfg.output_dir) / "online_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    versions = reg.versions()
    serving = reg.serving()
    newest = versions[-1] if versions else None
    out = {**state, "serving": serving and {k: serving[k] for k in ("id", "step", "promoted_at", "reason")},
           "newest_candidate": newest and {k: newest[k] for k in ("id", "status", "reason")},
           "versions": len(versions)}
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    typer.echo(f"serving: {out['serving']['id'] if serving else '-'} ({serving.get('reason', '') if serving else ''})")
    if newest:
        typer.echo(f"newest candidate: {newest['id']} {newest['status']}: {newest['reason']}")
    typer.echo(f"update {state.get('step', 0)}; queue {state.get('queued', 0)} "
               f"{state.get('queued_by_user', {})}; skipped {state.get('skipped', 0)} {state.get('skipped_by', {})}")
    live = {vid: {"score": round(sum(c[0] for c in by.values()) / max(1, sum(c[2] for c in by.values())), 3),
                  "labels": sum(c[2] for c in by.values()), "users": len(by)}
            for vid, by in ((v, live_counts(e)) for v, e in state.get("live", {}).items())}
    typer.echo(f"per-user rows in the window: {state.get('users', {})}; live score by version (counted labels, "
               f"after the per-user limits): {live}")


@app.command("versions")
def versions(ctx: typer.Context, config: Path = typer.Option(None, "--config", help="The learner's config YAML."),
             as_json: bool = typer.Option(False, "--json", help="Print them as JSON.")) -> None:
    """Every version: its status (serving, promoted, refused, rolled-back), gate scores and the feedback in it."""
    cfg = _opts(ctx, config)
    vs = _registry(cfg).versions()
    if as_json:
        typer.echo(json.dumps(vs, indent=1))
        return
    for v in vs:
        g = v.get("gate") or {}
        score = f" gate {g['candidate']:.3f} vs {g.get('served', float('nan')):.3f}" if "candidate" in g else ""
        typer.echo(f"{v['id']:>6}  step {v['step']:>4}  {v['status']:<11}{score}  feedback {len(v['feedback'])}  "
                   f"{v['reason']}")


def _push(cfg, vid: str, why: str, action: str) -> None:
    """The operator's push, on the learner's one path: a push that died half-way (the learner's, or an earlier
    command's) repaired first, then this one journaled with its lease, under the push lock with the registry's
    record of it (a learner's push is waited for, never interleaved), and the event recorded."""
    from paravt_agent.errors import ParaVTError
    from paravt_train.online.versions import push_version, repair_push, write_event
    from paravt_train.sync.lease import push_lock

    reg, out = _registry(cfg), Path(cfg.output_dir)
    journal = out / "push.json"
    try:
        version = reg.get(vid)
        with push_lock(journal, log=typer.echo):
            left = repair_push(cfg, journal, log=typer.echo)
            if left is not None:
                said = (f"a push of version {left['version']} ({left['sync']}, pid {left.get('pid')} on "
                        f"{left.get('host')}) never ended: generation continued on "
                        f"{', '.join(left['continued']) or 'no server'}"
                        + (f" (failed: {'; '.join(left['errors'])})" if left["errors"] else ""))
                typer.echo(said)
                write_event(out, {"event": "push-repaired", "version": left["version"], "servers": left["continued"],
                                  "errors": left["errors"], "reason": said, "by": "operator"})
            push_version(cfg, version, journal=journal, log=typer.echo)  # journaled, as the learner's are
            reg.set_serving(vid, reason=why)
        write_event(out, {"event": f"operator-{action}", "version": vid, "reason": why})
    except ParaVTError as exc:
        _fail(str(exc))
    typer.echo(f"{vid} now serves ({why})")


@app.command("promote")
def promote(ctx: typer.Context, version: str = typer.Argument(..., help="The version to serve (e.g. v12)."),
            config: Path = typer.Option(None, "--config", help="The learner's config YAML.")) -> None:
    """Serve a kept version (a refused candidate too, by the operator's decision)."""
    cfg = _opts(ctx, config)
    _push(cfg, version, "promoted by the operator", "promote")


@app.command("rollback")
def rollback(ctx: typer.Context, version: str = typer.Argument(None, help="The version to go back to (default: "
                                                                          "the newest one served before the current "
                                                                          "that was never rolled back)."),
             config: Path = typer.Option(None, "--config", help="The learner's config YAML.")) -> None:
    """Put an earlier version back on the server in one command. Without a version: the newest one served before
    the current that no rollback took back; a version that was rolled back is put back only when named (with a
    warning)."""
    from paravt_agent.errors import ParaVTError

    cfg = _opts(ctx, config)
    reg = _registry(cfg)
    if version is None:
        target = reg.rollback_target()
        if target is None:
            _fail("no earlier served version that was never rolled back (name one: paravt-train online rollback V)")
        version = target["id"]
    else:
        try:
            named = reg.get(version)
        except ParaVTError as exc:
            _fail(str(exc))
        if named["status"] == "rolled-back":
            typer.secho(f"warning: {version} was rolled back (a rollback took it off the server before): putting it "
                        "back because you named it", fg=typer.colors.YELLOW, err=True)
    _push(cfg, version, "rollback by the operator", "rollback")
