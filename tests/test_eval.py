"""The evaluation harness on small benchmark-shaped fixtures built here."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import Sampling, text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_train.eval import BenchmarkError, load_benchmark, results_table, run_eval
from paravt_train.toy.render import write_segments


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")

    def vid(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_segments(path, [((200, 30, 30), 3.0), ((30, 30, 200), 3.0)], fps=4, width=32, height=32)

    # VideoMME
    (root / "videomme" / "videomme").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"video_id": "001", "videoID": "abc", "duration": "short", "domain": "x", "question_id": "001-1",
         "question": "What colour comes first?", "options": ["A. red", "B. blue"], "answer": "A"},
        {"video_id": "001", "videoID": "abc", "duration": "short", "domain": "x", "question_id": "001-2",
         "question": "What colour comes last?", "options": ["A. red", "B. blue"], "answer": "B"},
    ]), root / "videomme" / "videomme" / "test-00000-of-00001.parquet")
    vid(root / "videomme" / "data" / "abc.mp4")
    (root / "videomme" / "subtitle").mkdir()
    (root / "videomme" / "subtitle" / "abc.srt").write_text("1\n00:00:00,000 --> 00:00:02,000\nhello red\n")
    # LongVideoBench
    (root / "longvideobench").mkdir()
    (root / "longvideobench" / "lvb_val.json").write_text(json.dumps([
        {"id": "l1", "video_path": "l1.mp4", "question": "Which colour first?", "candidates": ["red", "blue"],
         "correct_choice": 0, "duration_group": 15}]))
    vid(root / "longvideobench" / "videos" / "l1.mp4")
    # LVBench
    (root / "lvbench").mkdir()
    (root / "lvbench" / "video_info.meta.jsonl").write_text(json.dumps(
        {"key": "k1", "type": "cartoon", "qa": [{"uid": 7, "question": "Which colour first?\n(A) blue\n(B) red",
                                                 "answer": "(B)"}]}) + "\n")
    vid(root / "lvbench" / "videos" / "k1.mp4")
    # MLVU
    (root / "mlvu" / "json").mkdir(parents=True)
    (root / "mlvu" / "json" / "1_plotQA.json").write_text(json.dumps([
        {"video": "m1.mp4", "question": "Which colour first?", "candidates": ["blue", "red"], "answer": "red",
         "question_type": "plotQA"}]))
    vid(root / "mlvu" / "video" / "1_plotQA" / "m1.mp4")
    # MMVU
    (root / "mmvu").mkdir()
    (root / "mmvu" / "validation.json").write_text(json.dumps([
        {"id": "u1", "video": "https://x/videos/u1.mp4", "question": "Which colour first?",
         "choices": {"A": "red", "B": "blue"}, "answer": "A", "question_type": "multiple-choice"},
        {"id": "u2", "video": "https://x/videos/u1.mp4", "question": "Name the first colour.", "choices": {},
         "answer": "red", "question_type": "open-ended"}]))
    vid(root / "mmvu" / "videos" / "u1.mp4")
    # Charades-STA
    (root / "charades").mkdir()
    (root / "charades" / "charades_sta_test.txt").write_text("C1 3.0 6.0##the screen turns blue.\n")
    vid(root / "charades" / "videos" / "C1.mp4")
    return root


NAMES = ["videomme", "videomme_sub", "longvideobench", "lvbench", "mlvu", "mmvu", "charades"]


def test_loaders(benches):
    got = {n: load_benchmark(n, benches / n.replace("_sub", "")) for n in NAMES}
    assert [i.answer for i in got["videomme"]] == ["A", "B"] and got["videomme"][0].group == "short"
    assert got["videomme_sub"][0].question.startswith("Subtitles: hello red")
    assert got["longvideobench"][0].answer == "A" and got["longvideobench"][0].options == ["A. red", "B. blue"]
    assert got["lvbench"][0].answer == "B" and got["lvbench"][0].options == ["A. blue", "B. red"]
    assert got["lvbench"][0].question == "Which colour first?"
    assert got["mlvu"][0].answer == "B"
    assert [i.task for i in got["mmvu"]] == ["mcq", "oe"]
    assert got["charades"][0].task == "tvg" and got["charades"][0].answer == "[3.0, 6.0]"


def test_missing_data_is_a_clear_message(tmp_path, benches):
    with pytest.raises(BenchmarkError, match="expected .*lvb_val.json"):
        load_benchmark("longvideobench", tmp_path)
    with pytest.raises(BenchmarkError, match="benchmark folder not found"):
        load_benchmark("mlvu", tmp_path / "nope")
    (tmp_path / "charades").mkdir()
    (tmp_path / "charades" / "charades_sta_test.txt").write_text("ZZ 1 2##x\n")
    with pytest.raises(BenchmarkError, match="videos missing, e.g. expected .*ZZ.mp4"):
        load_benchmark("charades", tmp_path / "charades")


def oracle(role, msgs):
    """Answers from the annotations' logic: red first, blue last; the blue span is [3, 6]."""
    q = text_of(msgs[1]["content"])
    if "[start, end]" in q:
        return "<think>blue</think><answer>[3, 6]</answer>"
    if "Options:" not in q:
        return "<answer>red</answer>"
    want = "blue" if "last" in q else "red"
    letter = re.search(rf"([A-J])\. {want}", q).group(1)
    return f"<think>{want}</think><answer>{letter}</answer>"


def test_metrics_resume_and_shards(benches, tmp_path):
    items = [it for n in NAMES for it in load_benchmark(n, benches / n.replace("_sub", ""))]
    agent = Agent(policy=ScriptedPolicy(oracle), config=AgentConfig(mode="none"))
    out = tmp_path / "r.jsonl"
    recs = run_eval(agent, items, out, shard=(0, 2), progress=False)
    assert len(recs) == (len(items) + 1) // 2
    recs = run_eval(agent, items, out, shard=(1, 2), progress=False) + recs
    assert len(out.read_text().splitlines()) == len(items)
    assert run_eval(agent, items, out, progress=False) and len(out.read_text().splitlines()) == len(items)  # resume
    table = results_table(recs)
    assert "| charades | all | 1 | - | 100.0 | 100.0 | 100.0 | 100.0 |" in table
    assert "| videomme | all | 2 | 100.0 |" in table and "| videomme | short | 2 | 100.0 |" in table
    assert "| mmvu | open-ended | 1 | - | - | - | - | - | 100.0 |" in table


def test_runs_with_the_tiny_model(benches, tiny_model, tmp_path):
    cfg = AgentConfig(frames={"max_pixels": 1024, "max_frames": 8}, max_turns=1,
                      planner_sampling=Sampling(max_new_tokens=16), subagent_sampling=Sampling(max_new_tokens=8))
    agent = Agent(model=tiny_model, config=cfg)
    items = load_benchmark("charades", benches / "charades") + load_benchmark("mlvu", benches / "mlvu")
    recs = run_eval(agent, items, tmp_path / "t.jsonl", progress=False)
    assert {r["benchmark"] for r in recs} == {"charades", "mlvu"}
    # every record carries its task's metric, scored from the real model's response
    assert all(("iou" in r) == (r["task"] == "tvg") and ("correct" in r) == (r["task"] == "mcq") for r in recs)
    # a random tiny model writes no answer text: the record says so, and nothing else went wrong
    assert all(r["response"] and r["latency"] > 0 for r in recs)
    assert all(e.startswith("empty answer") for r in recs for e in r["errors"])
    assert "| charades | all | 1 |" in results_table(recs)


def test_before_after_intervals():
    from paravt_train.stats import mean_ci, paired_diff_ci

    assert mean_ci([0.5] * 10) == (0.5, 0.5, 0.5) and mean_ci([]) == (0.0, 0.0, 0.0)
    m, lo, hi = mean_ci([0, 1] * 20)
    assert m == 0.5 and 0.3 < lo < 0.5 < hi < 0.7
    gain = paired_diff_ci([0, 0, 0, 1] * 10, [1, 1, 0, 1] * 10)  # after - before: the gain is positive
    assert gain[0] == pytest.approx(0.5) and 0 < gain[1] < 0.5 < gain[2] <= 1
    with pytest.raises(ValueError, match="same questions"):
        paired_diff_ci([1, 0], [1])
