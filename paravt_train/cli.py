"""The ``paravt-train`` command: data checks and conversion, SFT, the toy world."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="ParaVT trainer: validate and convert data, SFT cold start, the toy world.",
    no_args_is_help=True,
    add_completion=False,
)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@app.callback()
def main() -> None:
    """ParaVT trainer."""


@app.command("validate-data")
def validate_data(
    file: Path = typer.Argument(..., help="Parquet file or dataset directory."),
    kind: str = typer.Option("sft", help="sft or rl."),
    video_root: Path = typer.Option(None, help="Resolve relative video paths against this folder."),
    no_video_check: bool = typer.Option(False, "--no-video-check", help="Do not check that videos exist."),
) -> None:
    """Check every row; print each bad row's number and reason. Exit 1 when any row is bad."""
    from paravt_train.data import DataError, validate_file

    try:
        ok, bad = validate_file(file, kind, video_root, check_videos=not no_video_check)
    except DataError as exc:
        _fail(str(exc))
    for row, why in bad:
        typer.echo(f"row {row}: {why}")
    typer.echo(f"{len(ok)} valid, {len(bad)} invalid rows in {file}")
    if bad:
        raise typer.Exit(1)


@app.command("sft")
def sft_cmd(
    config: Path = typer.Option(..., "--config", help="SFTConfig YAML file."),
    set_: list[str] = typer.Option(None, "--set", help="Override key=value, e.g. --set lr=1e-5 --set lora.enabled=true."),
) -> None:
    """Supervised fine-tuning (cold start). Run under `torchrun --nproc_per_node N` for FSDP2."""
    from paravt_agent.errors import ConfigError
    from paravt_train.sft import SFTConfig, train

    try:
        cfg = SFTConfig.from_yaml(config, list(set_ or []))
        result = train(cfg)
    except ConfigError as exc:
        _fail(str(exc))
    typer.echo(f"trained {result['steps']} steps; final loss {result['losses'][-1]:.4f}; "
               f"model in {Path(result['output_dir']) / 'final'}" if result["losses"] else "nothing to train")


if __name__ == "__main__":
    app()
