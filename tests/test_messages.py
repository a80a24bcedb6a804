"""What a user is told (issue 66): mistakes caught before any model work and answered with the fix, every hint naming
an option its command really has, config errors one line each with the closest key and where the value came from,
data checks grouped, FFmpeg's errors said as what is wrong with the file, degraded answers saying what to raise, and
help texts without developers' notes or `<bool>` after a flag."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {"paravt": "paravt_agent.cli", "paravt-train": "paravt_train.cli", "paravt-lmms": "paravt_lmms.cli"}
#: a command in backticks: a program, then its words up to the closing backtick
_COMMAND = re.compile(r"`((?:paravt-train|paravt-lmms|paravt|make) [^`]*)`")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _app(program: str):
    import importlib

    return importlib.import_module(PROGRAMS[program]).app


def help_of(words: tuple[str, ...]) -> str:
    """``PROGRAM WORDS... --help`` as the program prints it (run in this process)."""
    res = CliRunner().invoke(_app(words[0]), [*words[1:], "--help"], prog_name=words[0])
    assert res.exit_code == 0, (words, res.output)
    return res.output


def _subcommands(words: tuple[str, ...]) -> set[str]:
    import typer

    cmd = typer.main.get_command(_app(words[0]))
    for w in words[1:]:
        cmd = cmd.commands[w]
    return set(getattr(cmd, "commands", None) or ())


def hints(text: str, ran: tuple[str, ...] | None = None) -> list[tuple[tuple[str, ...], str]]:
    """``(command, option)`` for every option a text tells a user to pass: inside a backticked command, of that
    command (its subcommands read off the program itself); outside one, of the command the user ran (``ran``).
    ``make TARGET`` hints come back as ``(("make",), TARGET)``."""
    found: list[tuple[tuple[str, ...], str]] = []
    for m in _COMMAND.finditer(text):
        words = m.group(1).split()
        if words[0] == "make":
            found += [(("make",), w) for w in words[1:] if re.fullmatch(r"[a-z][a-z0-9-]*", w)]
            continue
        for variant in _alternatives(words):
            command = [variant[0]]
            for w in variant[1:]:
                if w.startswith("-") or w not in _subcommands(tuple(command)):
                    break  # an option or an argument: the command's words end here
                command.append(w)
            found += [(tuple(command), o) for o in _OPTION.findall(" ".join(variant))]
    if ran is not None:
        outside = _COMMAND.sub(" ", text)
        found += [(ran, o) for o in _OPTION.findall(outside)]
    return found


def _alternatives(words: list[str]) -> list[list[str]]:
    """``online promote|rollback`` as two commands."""
    for i, w in enumerate(words):
        if "|" in w and not w.startswith("-"):
            return [v for alt in w.split("|") for v in _alternatives([*words[:i], alt, *words[i + 1:]])]
    return [words]


def wrong_hints(found) -> list[str]:
    """The hints whose option the command's ``--help`` does not list (or whose make target does not exist)."""
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    helps: dict[tuple[str, ...], str] = {}
    wrong = []
    for command, option in found:
        if command == ("make",):
            if option not in targets:
                wrong.append(f"make {option}")
            continue
        if command not in helps:
            helps[command] = help_of(command)
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[command]):
            wrong.append(f"{' '.join(command)} {option}")
    return sorted(set(wrong))


def _strings(path: Path) -> list[str]:
    """Every string constant and f-string of a module (an f-string's fields as X)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def test_every_hint_in_the_code_names_an_option_its_command_has():
    """Every backticked command in the packages' strings (messages, help texts, docstrings), its options checked
    against its own `--help`; the scan catches an option a command lacks and a make target that does not exist."""
    found = []
    for pkg in ("paravt_agent", "paravt_train", "paravt_lmms", "tools"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for s in _strings(f):
                found += hints(s)
    found += [h for s in _strings(ROOT / "gradio_app.py") for h in hints(s)]
    assert len({c for c, _ in found}) >= 10  # the scan sees the commands the code names
    assert wrong_hints(found) == []
    assert wrong_hints(hints("run `paravt answer VIDEO Q --no-such-option` or `make no-such-target`")) == [
        "make no-such-target", "paravt answer --no-such-option"]
    assert wrong_hints(hints("open a prefix with --allow-url-prefix", ran=("paravt-train", "eval"))) == [
        "paravt-train eval --allow-url-prefix"]


def run(program: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", PROGRAMS[program], *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def talk(tmp_path_factory):
    from paravt_train.toy.world import make_world

    d = tmp_path_factory.mktemp("talk")
    make_world(7, mcq=1, oe=1, tvg=1).write(d / "talk.mp4")
    (d / "notes.mp4").write_text("meeting notes, not a video\n")
    return d


def test_the_hints_users_get_name_options_their_commands_have(talk, tmp_path):
    """The refusals a user meets, as each command prints them: every option they name is one the command (or the
    command named beside it) really has. Before, the loopback refusal told `paravt answer` users to pass
    --allow-url-prefix, which only `paravt api` had, and `paravt serve --device cpu` without SGLang named the GPU
    extra."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: checkpoints/toy\ndata: rl.parquet\nreward:\n  gama: 0.3\n")
    cases = [
        (("paravt", "answer"), ["http://127.0.0.1:9/x.mp4", "What colour?"], "loopback address"),
        (("paravt", "answer"), [str(talk / "talk.mp4"), "x" * 10_000], "max_question_tokens"),
        (("paravt", "answer"), [str(talk / "talk.mp4"), "What?", "--set", "max_turn=2"], "did you mean"),
        (("paravt", "answer"), [str(talk / "notes.mp4"), "What?"], "text file"),
        (("paravt", "serve"), ["some/model", "--device", "cpu"], "make sglang-cpu"),
        (("paravt-train", "grpo"), ["--config", str(cfg)], "reward.gamma"),
    ]
    for command, args, said in cases:
        res = run(command[0], *command[1:], *args)
        assert res.returncode == 1 and said in res.stderr, (command, args, res.stderr[-2000:])
        assert "Traceback" not in res.stderr
        told = res.stderr[res.stderr.index("error:"):]  # the refusal (a server's launch line before it is no hint)
        assert wrong_hints(hints(told, ran=command)) == [], (command, told)
    refusal = run("paravt", "answer", "http://127.0.0.1:9/x.mp4", "q").stderr
    assert (("paravt", "answer"), "--allow-url-prefix") in hints(refusal, ran=("paravt", "answer"))


def test_input_checks_run_before_any_model_loads(talk):
    """A fresh process: a 10,000-character question, an empty one, an empty option, a text file renamed .mp4 and a
    loopback URL are each refused within a second of asking, with the model not loaded and neither torch nor
    transformers imported (before, the question's length was checked after the model loaded: 45 s on a busy
    machine)."""
    code = f"""
import sys, time
from paravt_agent.agent import Agent
from paravt_agent.errors import ParaVTError
agent = Agent()  # the shipped toy policy, local
talk = {str(talk / 'talk.mp4')!r}
for video, question, options in [(talk, "x" * 10_000, None), (talk, " ", None), (talk, "What colour?", ["red", ""]),
                                 ({str(talk / 'notes.mp4')!r}, "What colour?", None),
                                 ("http://127.0.0.1:9/x.mp4", "What colour?", None)]:
    t0 = time.perf_counter()
    try:
        agent.answer(video, question, options)
        raise SystemExit("answered")
    except ParaVTError as exc:
        print(f"{{time.perf_counter() - t0:.3f}}\\t{{exc}}")
print("loaded", agent.policy._model is not None, "torch" in sys.modules, "transformers" in sys.modules)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    *refusals, loaded = res.stdout.strip().splitlines()
    assert loaded == "loaded False False False"
    said = [line.split("\t", 1) for line in refusals]
    assert all(float(seconds) < 1.0 for seconds, _ in said), said
    msgs = [m for _, m in said]
    assert "10000 characters" in msgs[0] and "--set max_question_tokens=10000" in msgs[0]
    assert "question is empty" in msgs[1] and "option B is empty" in msgs[2]
    assert "this is a text file" in msgs[3] and "loopback" in msgs[4]


def test_config_errors_say_the_key_the_closest_one_and_where_it_came_from(tmp_path):
    from paravt_agent.config import AgentConfig
    from paravt_agent.errors import ConfigError
    from paravt_train.rl.config import GRPOConfig

    with pytest.raises(ConfigError) as err:
        AgentConfig().override(["max_turn=2", "mode=diagonal"])
    lines = str(err.value).splitlines()[1:]
    assert sorted(lines) == [
        "  `max_turn` is not a setting; did you mean `max_turns`? (from --set max_turn=2)",
        "  `mode`: 'diagonal' is not allowed; choose one of 'parallel', 'sequential', 'none' or 'collaborative' "
        "(from --set mode=diagonal)"]
    f = tmp_path / "run.yaml"
    f.write_text("model: m\nreward:\n  gama: 0.3\n")
    with pytest.raises(ConfigError) as err:
        GRPOConfig.from_yaml(f, ["agentt.think_prefix=''", "lr=-1"])
    text = str(err.value)
    assert text.splitlines()[0] == f"invalid GRPOConfig ({f}):"
    assert f"`reward.gama` is not a setting of reward; did you mean `reward.gamma`? (in {f})" in text
    assert "`agentt` is not a setting; did you mean `agent`? (from --set agentt.think_prefix='')" in text
    assert "`lr`: input should be greater than 0 (got -1) (from --set lr=-1)" in text
    assert "pydantic" not in text and "Extra inputs are not permitted" not in text
    with pytest.raises(ConfigError, match=r"`agent.max_turn` is not a setting of agent; did you mean "
                                          r"`agent.max_turns`\? \(from --set agent.max_turn=3\)"):
        GRPOConfig.from_yaml(ROOT / "examples" / "configs" / "toy_grpo_para.yaml", ["agent.max_turn=3"])
    res = run("paravt", "answer", "v.mp4", "q?", "--set", "frames.fpz=2")
    assert res.stderr.strip() == ("error: invalid AgentConfig:\n  `frames.fpz` is not a setting of frames; did you "
                                  "mean `frames.fps`? (from --set frames.fpz=2)")


def test_validate_data_tells_sft_from_rl_and_groups_reasons(toy_rl, tmp_path):
    import pyarrow.parquet as pq

    res = run("paravt-train", "validate-data", toy_rl["data"], "--video-root", toy_rl["video_root"])
    assert res.returncode == 0 and res.stdout.strip().endswith(f"12 valid, 0 invalid RL rows in {toy_rl['data']}")
    res = run("paravt-train", "validate-data", toy_rl["data"], "--kind", "sft")
    assert res.returncode == 1 and f"`paravt-train validate-data {toy_rl['data']} --kind rl`" in res.stderr
    pq.write_table(pq.read_table(toy_rl["data"]).drop(["answer"]), tmp_path / "no_answer.parquet")
    res = run("paravt-train", "validate-data", str(tmp_path / "no_answer.parquet"), "--kind", "rl",
              "--no-video-check")
    assert res.returncode == 1
    assert res.stdout.splitlines() == ["rows 0-11 (12 rows): column `answer` is missing",
                                       f"0 valid, 12 invalid RL rows in {tmp_path / 'no_answer.parquet'}"]
    from paravt_train.data import DataError, load_sft

    with pytest.raises(DataError, match="--kind rl"):  # what `paravt-train sft` says when given RL rows
        load_sft(toy_rl["data"])


def test_ffmpeg_errors_say_what_is_wrong_with_the_file(tmp_path, media):
    from paravt_agent.errors import VideoError
    from paravt_agent.video import open_video

    files = {"notes.mp4": b"meeting notes, not a video\n", "page.mp4": b"<!DOCTYPE html><html>Not found</html>",
             "frame.mp4": b"\x89PNG\r\n\x1a\n" + bytes(64), "noise.mp4": bytes(range(256)) * 8}
    said = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(VideoError) as err:
            open_video(tmp_path / name)
        said[name] = str(err.value)
    assert "this is a text file (it begins 'meeting notes, not a video')" in said["notes.mp4"]
    assert "this is an HTML page" in said["page.mp4"] and "this is a PNG image" in said["frame.mp4"]
    assert "no video container was recognised in it (it begins with the bytes 00 01 02" in said["noise.mp4"]
    assert all("Errno" not in s and "InvalidDataError" not in s for s in said.values()), said
    open_video(media["video"])  # a real video still opens


def test_a_degraded_answer_says_which_setting_to_raise(media):
    import asyncio

    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.base import text_of
    from paravt_agent.policy.scripted import ScriptedPolicy

    calls = "".join(f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {a}, "end_time": {a + 8}}}}}'
                    "</tool_call>" for a in (0, 10, 20))

    def script(role, messages):
        if role == "subagent":
            return "A green screen."
        if "<tool_response>" in text_of(messages[-1]["content"]):
            return "<think>\nGreen.</think>\n<answer>B</answer>"
        return "<think>\nThree windows.</think>\n" + calls

    class OneSlow(ScriptedPolicy):  # the first sub-agent to start needs 3 s, the others none
        started = 0

        async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
            if role == "subagent":
                OneSlow.started += 1
                if OneSlow.started == 1:
                    await asyncio.sleep(3)
            return await super().generate(messages, sampling, prefix, role=role)

    ans = Agent(policy=OneSlow(script), config=AgentConfig(subagent_timeout=0.5, retries=0)).answer(
        media["video"], "What colour?", ["red", "green"])
    assert ans.status == "degraded"
    [advice] = ans.trace.advice
    assert advice.startswith("1 of 3 tool calls timed out: each needed more than subagent_timeout = 0.5s of work "
                             "(the 2 that finished took up to ")
    assert "raise subagent_timeout to 1 or more: `paravt answer --set subagent_timeout=1`" in advice
    assert f"To change: {advice}" in ans.trace.render()


def test_help_shows_no_developer_note_and_no_bool_after_a_flag():
    for words in (("paravt", "serve"), ("paravt", "answer"), ("paravt", "tools"), ("paravt-train", "online"),
                  ("paravt-train", "quickstart")):
        text = help_of(words)
        assert "Long by design" not in text and "<bool>" not in text, (words, text)
    assert re.search(r"--dry-run +Print the command", help_of(("paravt", "serve")))
