"""The ``paravt-lmms`` command: local lmms-eval tasks over toy videos (the plugin model itself is ``lmms-eval --model
paravt``, registered by the ``lmms_eval.models`` entry point)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="ParaVT's lmms-eval plugin: write local toy tasks (then `lmms-eval --model paravt`).",
                  no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)  # click's help layout (paravt_agent.cli says why)


@app.callback()
def main() -> None:
    """ParaVT's lmms-eval plugin."""


@app.command("task")
def task_cmd(
    out: Path = typer.Option(..., "--out", help="Folder for the videos, test.jsonl and the task YAMLs."),
    worlds: int = typer.Option(4, min=1, help="Held-out toy videos (3 colour-at-t MCQ questions each)."),
) -> None:
    """Write local lmms-eval tasks over toy videos (no hub): paravt_toy (ParaVT's prompt, lmms-eval's MCQ
    scoring) and paravt_toy_videomme (Video-MME's own prompt, parsing and score). Then:
    lmms-eval --model paravt --include_path OUT --tasks paravt_toy,paravt_toy_videomme"""
    # lazy: the toy world imports torch
    from paravt_lmms.toy_task import write_toy_task

    path = write_toy_task(out, worlds=worlds, progress=True)
    typer.echo(f"wrote {path}: lmms-eval --model paravt --include_path {path} --tasks paravt_toy,paravt_toy_videomme")
