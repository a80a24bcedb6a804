"""The ``paravt`` command: answer questions about videos, serve a model, list tools."""

from __future__ import annotations

import json

import typer

app = typer.Typer(
    help="ParaVT: parallel video tool calling for long-video question answering.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """ParaVT: parallel video tool calling for long-video question answering."""


@app.command("tools")
def tools_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the OpenAI-style function schemas as JSON."),
) -> None:
    """List the available tools (built-ins and `paravt.tools` entry-point plugins) with their schemas."""
    from tools import ToolRegistry

    reg = ToolRegistry.default()
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
        kind = "visual, summarised by a sub-agent" if tool.visual else "text"
        typer.echo(f"{tool.name}({args})  [{kind}]\n    {tool.description}")


if __name__ == "__main__":
    app()
