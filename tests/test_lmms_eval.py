"""``lmms-eval --model paravt``: the real lmms-eval CLI (in .venv-lmms, `make lmms-eval`) runs the agent on local
toy tasks (no hub) and scores it with its own task functions; the per-sample traces land beside its outputs."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paravt_agent.agent import Agent
from paravt_lmms.toy_task import write_toy_task
from tests.conftest import engine_unavailable

ROOT = Path(__file__).resolve().parent.parent
LMMS_EVAL = ROOT / ".venv-lmms" / "bin" / "lmms-eval"



@pytest.fixture(autouse=True)
def _lmms_eval_installed():
    """Skipped without lmms-eval (`make lmms-eval`), saying so; a failure under PARAVT_REQUIRE_ENGINES (CI)."""
    engine_unavailable(None if LMMS_EVAL.exists() else "lmms-eval is not installed (make lmms-eval)")


def lmms_eval(tmp_path, tasks: str, out: Path, plugins_env: bool = False, extra=()) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("LMMS_EVAL_PLUGINS", None)
    if plugins_env:
        env["LMMS_EVAL_PLUGINS"] = "paravt_lmms"  # the older hook; the entry point registers it otherwise
    cmd = [str(LMMS_EVAL), "--model", "paravt", "--model_args", "concurrency=4", "--include_path",
           str(tmp_path / "task"), "--tasks", tasks, "--output_path", str(out), "--log_samples", *extra]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = glob.glob(str(out / "*_results.json"))
    return json.loads(Path(results).read_text())["results"]


def test_lmms_eval_scores_the_agent_with_its_own_task_functions(tmp_path):
    # the two commands of docs/evaluation.md (its block is skipped there: this runs it), as a user types them
    made = subprocess.run([sys.executable, "-c", "from paravt_lmms.cli import app; app()", "task", "--out",
                           str(tmp_path / "task"), "--worlds", "2"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    task = tmp_path / "task"
    rows = [json.loads(ln) for ln in (task / "test.jsonl").read_text().splitlines()]
    out = tmp_path / "out"
    results = lmms_eval(tmp_path, "paravt_toy,paravt_toy_videomme", out)

    # ParaVT's layout: lmms-eval's accuracy is what the same agent scores in-process on the same questions
    agent = Agent()  # the shipped toy policy, greedy by its agent config
    direct = [agent.answer(r["video"], r["question"], r["choices"]).choice == r["answer"] for r in rows]
    assert results["paravt_toy"]["accuracy,none"] == pytest.approx(sum(direct) / len(rows))
    assert sum(direct) >= len(rows) // 2  # the toy policy answers its own protocol's questions

    # one trace per sample beside lmms-eval's outputs, and they are what lmms-eval scored
    for name in ("paravt_toy", "paravt_toy_videomme"):
        [path] = glob.glob(str(out / "paravt_traces" / f"*_{name}.jsonl"))
        traces = [json.loads(ln) for ln in Path(path).read_text().splitlines()]
        [samples] = glob.glob(str(out / f"*_samples_{name}.jsonl"))
        samples = {s["doc_id"]: s for s in map(json.loads, Path(samples).read_text().splitlines())}
        assert sorted(t["doc_id"] for t in traces) == sorted(samples) == list(range(len(rows)))
        for t in traces:
            # the prompt's option lines became the question's options (the toy's are labelled "A. ...")
            assert t["trace"]["options"] == [c.split(". ", 1)[1] for c in rows[t["doc_id"]]["choices"]]
            assert samples[t["doc_id"]]["filtered_resps"] in (t["choice"], t["answer"])
            assert samples[t["doc_id"]]["token_counts"][0]["output_tokens"] == sum(
                x["completion_tokens"] + sum(c["completion_tokens"] for c in x["calls"]) for x in t["trace"]["turns"])
        if name == "paravt_toy_videomme":  # Video-MME's own prompt, parser and score (percent)
            assert all(t["trace"]["question"].startswith("Select the best answer") for t in traces)
            right = [t["choice"] == rows[t["doc_id"]]["answer"] for t in traces]
            assert results[name]["videomme_perception_score,none"] == pytest.approx(100 * sum(right) / len(rows))


def test_the_older_plugin_hook_registers_the_model_too(tmp_path):
    write_toy_task(tmp_path / "task", worlds=1)
    results = lmms_eval(tmp_path, "paravt_toy", tmp_path / "out", plugins_env=True, extra=["--limit", "1"])
    assert "accuracy,none" in results["paravt_toy"]
