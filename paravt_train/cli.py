"""The ``paravt-train`` command: data checks and conversion, SFT, PARA-GRPO, online learning, the toy world.

Lazy imports: each command imports the modules it runs inside its own body, so `paravt-train --help` and every other
command stay instant (torch, transformers and the servers load only for the command that needs them).
"""

from __future__ import annotations

from pathlib import Path

import typer

from paravt_train.online.cli import app as online_app

app = typer.Typer(
    help="ParaVT trainer: validate and convert data, SFT cold start, PARA-GRPO, online learning, the toy world.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help layout: typer's rich panels show a flag as `--json <bool>`
)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@app.callback()
def main() -> None:
    """ParaVT trainer."""



def stopped_exit_code() -> int:
    """A run stopped by SIGTERM (checkpointed, resumable) exits as a terminated process does: 143."""
    from paravt_train.infra.interrupt import EXIT_CODE

    return EXIT_CODE

@app.command("validate-data")
def validate_data(
    file: Path = typer.Argument(..., help="Parquet file or dataset directory."),
    kind: str = typer.Option("auto", help="auto (by the file's columns: messages for SFT; prompt and answer for "
                             "RL), sft or rl."),
    video_root: Path = typer.Option(None, help="Resolve relative video paths against this folder."),
    no_video_check: bool = typer.Option(False, "--no-video-check", help="Do not check that videos exist."),
) -> None:
    """Check every row; print each reason once with the rows it applies to and their count. Exit 1 when any row is
    bad."""
    from paravt_train.data import DataError, detect_kind, group_errors, validate_file

    try:
        ok, bad = validate_file(file, kind, video_root, check_videos=not no_video_check)
        kind = detect_kind(file) if kind == "auto" else kind
    except DataError as exc:
        _fail(str(exc))
    for line in group_errors(bad):
        typer.echo(line)
    typer.echo(f"{len(ok)} valid, {len(bad)} invalid {kind.upper()} rows in {file}")
    if bad:
        raise typer.Exit(1)


@app.command("convert")
def convert_cmd(
    src: Path = typer.Argument(..., help="Sequential SFT traces (Parquet, messages as JSON)."),
    dst: Path = typer.Argument(..., help="Output Parquet with parallel traces."),
) -> None:
    """Merge independent sequential crop calls into parallel turns; frames become text summaries."""
    from paravt_train.data import DataError, iter_rows, write_parquet
    from paravt_train.data.convert import convert_rows

    try:
        rows = [r for _, r in iter_rows(src)]
    except DataError as exc:
        _fail(str(exc))
    out, stats = convert_rows(rows)
    write_parquet(out, dst)
    typer.echo(stats.report())
    typer.echo(f"wrote {len(out)} samples to {dst}")


@app.command("prefilter")
def prefilter_cmd(
    src: Path = typer.Argument(..., help="RL Parquet file."),
    dst: Path = typer.Argument(..., help="Filtered RL Parquet file."),
    config: Path = typer.Option(None, "--config", help="The GRPO config YAML of the run that will train on the data: "
                                "its agent protocol and method, reward, judge, τ, G, model and rollout backend "
                                "(each option below wins where given). Omit: the paper's protocol and reward."),
    set_: list[str] = typer.Option(None, "--set", help="Override a --config key, e.g. --set method=dapo."),
    video_root: Path = typer.Option(None, help="Resolve relative video paths against this folder (default: the "
                                    "config's video_root)."),
    model: str = typer.Option(None, help="Policy for the zero-variance rollout check (default: the config's model; "
                              "omit both: length rule only)."),
    backend: str = typer.Option(None, help="local, openai or sglang (default: the config's backend, else local)."),
    endpoint: str = typer.Option(None, help="Endpoint for openai/sglang (default: the config's)."),
    group: int = typer.Option(None, help="Rollouts per prompt, G (default: the config's group_size, else 8)."),
    temperature: float = typer.Option(None, help="Sampling temperature of the rollouts, τ (default: the config's, "
                                      "else 0.7)."),
    max_answer_words: int = typer.Option(15, help="Drop open-ended samples with longer answers."),
) -> None:
    """DAPO-style zero-gradient pre-filter: long open-ended answers, and prompts whose G rollouts under the policy
    all score alike under the RL reward (GRPO's advantages would all be 0). With --config, under the run's own
    protocol and reward (a dapo, weaver or vanilla-grpo run filters its data as it will train on it)."""
    from paravt_agent.errors import ParaVTError
    from paravt_train.data import load_rl, write_parquet
    from paravt_train.data.prefilter import prefilter

    try:
        reward = judge = agent_cfg = None
        if config is not None:  # the run's rollouts: its protocol, method, τ, token limits; its reward and judge
            from paravt_train.judge import LLMJudge
            from paravt_train.rl.config import GRPOConfig
            from paravt_train.rl.trainer import GRPOTrainer

            run = GRPOConfig.from_yaml(config, list(set_ or []))
            agent_cfg = GRPOTrainer(run, progress=False).agent_config()
            if temperature is not None:
                agent_cfg = agent_cfg.override([f"{k}.temperature={temperature}" for k in (
                    "planner_sampling", "subagent_sampling", "tool_sampling", "collab.agent_sampling")])
            reward = run.reward
            judge = LLMJudge.from_settings(run.reward.judge) if run.reward.judge is not None else None
            model = model or run.model
            backend, endpoint = backend or run.backend, endpoint or run.endpoint
            group = group or run.group_size
            video_root = video_root or (Path(run.video_root) if run.video_root else None)
        elif set_:
            _fail("--set overrides a --config: give the GRPO config YAML")
        backend, group = backend or "local", group or 8
        samples = load_rl(src, video_root)
        agent = None
        if model or backend != "local":
            from paravt_agent.agent import Agent
            from paravt_agent.config import AgentConfig

            if agent_cfg is None:
                tau = 0.7 if temperature is None else temperature
                agent_cfg = AgentConfig().override([f"planner_sampling.temperature={tau}",
                                                    f"subagent_sampling.temperature={tau}"])
            agent = Agent(model=model, backend=backend, endpoint=endpoint, config=agent_cfg)
        kept, dropped = prefilter(samples, agent, group=group, max_answer_words=max_answer_words,
                                  video_root=video_root, reward=reward, judge=judge)
    except ParaVTError as exc:
        _fail(str(exc))
    write_parquet([s.model_dump(mode="json", by_alias=True) for s in kept], dst)
    for why, n in sorted(dropped.items()):
        typer.echo(f"dropped ({why}): {n}")
    typer.echo(f"kept {len(kept)} of {len(samples)} samples -> {dst}")


@app.command("sft")
def sft_cmd(
    config: Path = typer.Option(..., "--config", help="SFTConfig YAML file."),
    set_: list[str] = typer.Option(None, "--set",
                                   help="Override key=value, e.g. --set lr=1e-5 --set lora.enabled=true."),
) -> None:
    """Supervised fine-tuning (cold start). Run under `torchrun --nproc_per_node N` for FSDP2."""
    from paravt_agent.errors import ConfigError, ParaVTError
    from paravt_train.infra.distributed import end_process
    from paravt_train.sft import train
    from paravt_train.sft.config import SFTConfig

    try:
        cfg = SFTConfig.from_yaml(config, list(set_ or []))
        result = train(cfg)
    except (ConfigError, ParaVTError) as exc:
        _fail(str(exc))
    if result.get("stopped"):
        end_process(stopped_exit_code())
        raise typer.Exit(stopped_exit_code())
    typer.echo(f"trained {result['steps']} steps; final loss {result['losses'][-1]:.4f}; "
               f"model in {Path(result['output_dir']) / 'final'}" if result["losses"] else "nothing to train")
    end_process(0)


@app.command("toy")
def toy_cmd(
    out: Path = typer.Option(None, "--out",
                             help="Output folder (default: $PARAVT_HOME/toy, i.e. ~/.cache/paravt/toy)."),
    train_worlds: int = typer.Option(None, help="Training videos (default 400)."),
    test_worlds: int = typer.Option(None, help="Held-out videos (disjoint seeds; default 60)."),
    steps: int = typer.Option(None, help="SFT steps of batch 16 of the first stage (default 1800)."),
    size: str = typer.Option(None, help="Tiny model size: toy (default, 1.2 M parameters) or test."),
    seed: int = typer.Option(None, help="World and training seed (default 0)."),
    init: Path = typer.Option(None, "--init", help="Warm start: fine-tune this policy directory (e.g. an earlier "
                                                   "toy policy) instead of a fresh tiny model, --steps steps on "
                                                   "the shipped plans (no further stages unless --set then=...)."),
    set_: list[str] = typer.Option(None, "--set", help="Any other ToyConfig field as key=value (lr, batch_size, "
                                                       "mcq, oe, tvg, vocab_size, ...)."),
) -> None:
    """Build the toy world (videos, SFT/RL data, held-out split) and train the tiny policy; cached.

    The defaults are the shipped policy's recipe, from scratch: a copy warm-up, 1800 SFT steps on the
    first stage's traces (plans: neighbours), then 500 and 400 steps at lr 5e-4 on the shipped plans
    (then; 56.5 min on 2 CPU cores; checkpoints/toy/COMMAND.txt). --set 'then=[]' trains the first stage
    only."""
    from paravt_agent.config import apply_overrides
    from paravt_agent.defaults import paravt_home
    from paravt_agent.errors import ConfigError
    from paravt_train.toy.build import ToyConfig, build

    given = {"train_worlds": train_worlds, "test_worlds": test_worlds, "steps": steps, "size": size, "seed": seed,
             "init": str(init) if init else None}
    try:
        cfg = ToyConfig(out=str(out or paravt_home() / "toy"), **{k: v for k, v in given.items() if v is not None})
        cfg = apply_overrides(cfg, set_)
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    try:
        build(cfg, log=lambda m: typer.echo(m, err=True))
    except ConfigError as exc:
        _fail(str(exc))


@app.command("toy-video")
def toy_video_cmd(
    out: Path = typer.Argument(..., help="Where to write the mp4."),
    seed: int = typer.Option(123, help="The world's seed (the same seed gives the same video)."),
) -> None:
    """Write one toy video (a timeline of solid colours, 64-128 s) and print questions about it with their
    answers: a sample input for `paravt answer` and the Gradio demo (the toy policy only knows such videos)."""
    from paravt_train.toy.world import make_world

    w = make_world(seed, mcq=1, oe=1, tvg=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write(out)
    typer.echo(f"wrote {out}: {w.duration} s, {len(w.segments)} colour segments")
    for q in w.questions:
        opts = "".join(f' -o "{o.split(". ", 1)[1]}"' for o in q.options or [])
        typer.echo(f'  paravt answer {out} "{q.question}"{opts}    # answer: {q.answer}')


@app.command("toy-data")
def toy_data_cmd(
    out: Path = typer.Argument(Path("data/toy"), help="The folder to write (the toy configs in examples/configs/ "
                               "read data/toy, relative to the repository root)."),
    worlds: int = typer.Option(8, min=1, help="Training videos (4 questions each: 2 MCQ, 1 open-ended, 1 grounding)."),
    heldout: int = typer.Option(4, min=1, help="Held-out videos (disjoint seeds)."),
    seed: int = typer.Option(0, min=0, help="First seed of the training worlds."),
) -> None:
    """Write the toy data the shipped toy configs train on (seconds, no model): videos, SFT and RL Parquet files
    and a feedback store. Then: `paravt-train sft --config examples/configs/toy_sft.yaml`, `paravt-train grpo
    --config examples/configs/toy_grpo_para.yaml`, ... (docs/training.md)."""
    from paravt_train.toy.dataset import write_toy_data

    typer.echo(write_toy_data(out, worlds=worlds, heldout=heldout, seed=seed).report())


@app.command("eval")
def eval_cmd(
    benchmark: list[str] = typer.Option(..., "--benchmark", "-b", help="videomme, videomme_sub, longvideobench, "
                                        "lvbench, mlvu, mlvu_generation, mmvu, charades or toy; repeat for "
                                        "several."),
    root: list[str] = typer.Option(None, "--root", help="Benchmark folder as name=path (default: DATA_ROOT/name; "
                                   "videomme_sub reads videomme's, mlvu_generation mlvu's)."),
    data_root: Path = typer.Option(Path("data/benchmarks"), help="Folder holding one sub-folder per benchmark."),
    backend: str = typer.Option("local", help="local, openai or sglang."),
    model: str = typer.Option(None, help="Model directory (local/sglang) or served model name (openai)."),
    endpoint: str = typer.Option(None, help="Endpoint for openai/sglang."),
    mode: str = typer.Option(None, help="Dispatch mode: parallel, sequential or none (the dispatch ablation); "
                                        "default: the config's (parallel)."),
    preset: str = typer.Option(None, help="Protocol preset: paravt, paravt-rl, paravt-eval (the released "
                                          "driver's Table 1 protocol), longvt (default: the model's own)."),
    config: Path = typer.Option(None, help="AgentConfig YAML (default: the model directory's agent_config.yaml, "
                                           "else the paper's protocol, greedy)."),
    set_: list[str] = typer.Option(None, "--set", help="AgentConfig override key=value."),
    out: Path = typer.Option(Path("runs/eval/results.jsonl"), help="Per-sample JSONL (appended; resume skips "
                             "answered items and asks failed ones again; an item's last line counts)."),
    concurrency: int = typer.Option(4, help="Questions in flight."),
    shard: str = typer.Option("0/1", help="i/k: this machine takes every k-th item starting at i."),
    limit: int = typer.Option(None, help="Only the first N items of each benchmark."),
    reruns: int = typer.Option(1, min=0, help="Ask a question the runtime spoiled (a timed-out or failed tool "
                               "call, an endpoint error) again up to N times; one that still fails is counted "
                               "as an error, never as a wrong answer, and is asked again on resume."),
) -> None:
    """Evaluate an agent on the paper's benchmarks; writes per-sample JSONL and prints a Markdown summary."""
    from paravt_agent.agent import Agent
    from paravt_agent.config import resolve_agent_config
    from paravt_agent.errors import ParaVTError
    from paravt_train.benchmarks import folder_of
    from paravt_train.eval import load_benchmark, results_table, run_eval

    roots = dict(r.split("=", 1) for r in (root or []))
    try:
        i, k = (int(x) for x in shard.split("/"))
        assert 0 <= i < k
    except (ValueError, AssertionError):
        _fail(f"--shard {shard!r} must look like i/k with 0 <= i < k")
    try:
        items = []
        for name in benchmark:
            loaded = load_benchmark(name, roots.get(name, data_root / folder_of(name)))
            items += loaded[:limit] if limit else loaded
        # one rule for every entry point: --config, else --preset, else the model's agent_config.yaml, else defaults
        notes: list[str] = []
        overrides = [*([f"mode={mode}"] if mode else []), *(set_ or [])]
        cfg = resolve_agent_config(config, model if backend != "openai" else None, overrides, preset=preset,
                                   notes=notes)
        for note in notes:
            typer.echo(note, err=True)
        agent = Agent(model=model, backend=backend, endpoint=endpoint, config=cfg)
        records = run_eval(agent, items, out, concurrency=concurrency, shard=(i, k), reruns=reruns)
    except ParaVTError as exc:
        _fail(str(exc))
    typer.echo(results_table(records))


@app.command("quickstart")
def quickstart_cmd(
    model: Path = typer.Option(None, help="Toy policy directory (default: the checkpoint shipped in checkpoints/toy)."),
    full: bool = typer.Option(False, "--full", help="The docs' table: 16 held-out videos and the per-role check on "
                              "8 (2.2 min on an idle 2-core AMD EPYC); default: the quick look, 4 videos."),
    worlds: int = typer.Option(None, help="Held-out videos to evaluate (5 questions each: 3 MCQ, 1 open-ended, "
                                          "1 grounding; default 4, with --full 16)."),
    n: list[int] = typer.Option([4, 8, 64], "--n", help="Overview sizes to evaluate."),
    mode: list[str] = typer.Option(["parallel", "sequential", "none"], "--mode", help="Dispatch modes to evaluate."),
    roles: int = typer.Option(None, help="Score each role alone (planner, sub-agent, answer step) on this many "
                                         "held-out videos (default 4, with --full 8); 0 skips it."),
    out: Path = typer.Option(None, "--out", help="Videos and results.json (default: $PARAVT_HOME/quickstart)."),
    seed: int = typer.Option(900_000, min=0, help="First seed of the held-out toy worlds (seeds SEED .. SEED + "
                             "worlds - 1); the default range is the one the README's table uses; training uses "
                             "seeds below 900,000."),
) -> None:
    """Run the real agent on held-out toy videos: one full trace, per-role accuracy and a results table (with the
    share of questions the runtime failed: a timed-out sub-agent is an error, never a wrong answer)."""
    from paravt_train.toy.quickstart import run

    try:
        run(model, out=out, worlds=worlds, modes=tuple(mode), ns=tuple(n), log=typer.echo, roles=roles, seed=seed,
            full=full)
    except FileNotFoundError as exc:
        _fail(str(exc))



@app.command("grpo")
def grpo_cmd(
    config: Path = typer.Option(..., "--config", help="GRPOConfig YAML (see examples/configs/paragrpo_*.yaml)."),
    set_: list[str] = typer.Option(None, "--set", help="Override key=value, e.g. --set method=vanilla-grpo "
                                                       "--set reward.gamma=0 --set gating=false."),
) -> None:
    """GRPO by a training method (para-grpo, vanilla-grpo, dapo, weaver, videochat-m1: `method` in the config)
    from an RL Parquet file; resumes from the newest checkpoint.

    Metrics per step go to OUTPUT_DIR/metrics.jsonl; `paravt-train plot OUTPUT_DIR` draws them.
    Multi-GPU: `torchrun --nproc_per_node N --no-python paravt-train grpo ...` with backend sglang."""
    from paravt_agent.errors import ConfigError, ParaVTError
    from paravt_train.infra.distributed import end_process, shutdown_distributed
    from paravt_train.rl import trainer_class
    from paravt_train.rl.config import GRPOConfig

    try:
        cfg = GRPOConfig.from_yaml(config, list(set_ or []))
        summary = trainer_class(cfg.method)(cfg).run()  # the method's trainer
    except (ConfigError, ParaVTError) as exc:
        _fail(str(exc))
    finally:
        shutdown_distributed()
    if summary.get("stopped"):
        end_process(stopped_exit_code())
        raise typer.Exit(stopped_exit_code())
    last = summary.get("last_step") or {}
    typer.echo(f"done: reward {last.get('reward', float('nan')):.3f}, f_tau {last.get('f_tau', float('nan')):.3f}, "
               f"kappa {last.get('kappa', float('nan')):.2f}; model in {summary['final_model']}")
    end_process(0)


@app.command("plot")
def plot_cmd(
    run: str = typer.Argument(..., help="A run folder (with metrics.jsonl), a folder of runs, or run1,run2."),
    out: Path = typer.Option(None, help="PNG path (default: RUN/curves.png)."),
) -> None:
    """Draw reward, f_tau, kappa, accuracy, KL, entropy and clip-fraction curves of GRPO runs (PNG)."""
    from paravt_agent.errors import ConfigError
    from paravt_train.eval.plot import plot

    try:
        path = plot(run, out)
    except ConfigError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {path}")


app.add_typer(online_app, name="online")


if __name__ == "__main__":
    app()
