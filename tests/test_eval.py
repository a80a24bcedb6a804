"""The evaluation harness on small benchmark-shaped fixtures built here."""

import json
import re
from pathlib import Path

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

    # Each fixture mirrors rows of the published files field for field (values shortened, colours
    # swapped in so the scripted oracle can answer); the rows that broke the old loaders are included.
    # VideoMME (lmms-lab/Video-MME: videomme/test-00000-of-00001.parquet, data/, subtitle/)
    (root / "videomme" / "videomme").mkdir(parents=True)
    row = {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
           "url": "https://www.youtube.com/watch?v=fFjv93ACGo8", "videoID": "fFjv93ACGo8",
           "task_type": "Counting Problem", "options": ["A. red", "B. blue"]}
    pq.write_table(pa.Table.from_pylist([
        {**row, "question_id": "001-1", "question": "What colour comes first?", "answer": "A"},
        {**row, "question_id": "001-2", "question": "What colour comes last?", "answer": "B"},
    ]), root / "videomme" / "videomme" / "test-00000-of-00001.parquet")
    vid(root / "videomme" / "data" / "fFjv93ACGo8.mp4")
    (root / "videomme" / "subtitle").mkdir()
    # a long subtitle file: the line that matters comes after the first 4000 characters
    cues = [f"{i + 1}\n00:00:{i % 60:02d},000 --> 00:00:{i % 60:02d},500\nfiller line number {i}\n"
            for i in range(200)]
    cues.append("201\n00:00:05,000 --> 00:00:05,900\nthe last colour is blue\n")
    (root / "videomme" / "subtitle" / "fFjv93ACGo8.srt").write_text("\n".join(cues))
    # LongVideoBench (longvideobench/LongVideoBench: lvb_val.json, videos/)
    (root / "longvideobench").mkdir()
    (root / "longvideobench" / "lvb_val.json").write_text(json.dumps([
        {"video_id": "86CxyhFV9MI", "question": "Which colour first?", "question_wo_referring_query":
         "Which colour first?", "candidates": ["red", "blue"], "correct_choice": 0, "position": [1, 2],
         "topic_category": "NP-News-Programs", "question_category": "TOS", "level": "L2-Relation",
         "id": "86CxyhFV9MI_0", "video_path": "86CxyhFV9MI.mp4", "subtitle_path": "86CxyhFV9MI_en.json",
         "duration_group": 15, "starting_timestamp_for_subtitles": 0, "duration": 6.0}]))
    vid(root / "longvideobench" / "videos" / "86CxyhFV9MI.mp4")
    # LVBench (THUDM/LVBench: video_info.meta.jsonl; videos from video2dataset: index names + sidecar json)
    (root / "lvbench").mkdir()
    (root / "lvbench" / "video_info.meta.jsonl").write_text(json.dumps(
        {"key": "sqYDFE-CdNE", "type": "documentary", "qa": [
            {"uid": "1", "question": "Which colour first?\n(A) blue (the sky's)\n(B) red (a rose's)",
             "answer": "B", "question_type": ["key information retrieval", "entity recognition"],
             "time_reference": "00:00-00:03"},
            {"uid": "2", "question": "Which colour last?\n(A) red\n(B) blue", "answer": "B",
             "question_type": ["temporal grounding"], "time_reference": "00:03-00:06"}],
         "video_info": {"start_time": 0, "duration_minutes": 0.1, "fps": 4.0,
                        "resolution": {"width": 32, "height": 32}}}) + "\n")
    vid(root / "lvbench" / "videos" / "00000" / "000000000.mp4")
    (root / "lvbench" / "videos" / "00000" / "000000000.json").write_text(json.dumps(
        {"url": "https://www.youtube.com/watch?v=sqYDFE-CdNE", "key": "000000000", "status": "success"}))
    # MLVU (MLVU/MVLU: json/<n>_<task>.json, video/<n>_<task>/), generation tasks included
    (root / "mlvu" / "json").mkdir(parents=True)
    (root / "mlvu" / "json" / "1_plotQA.json").write_text(json.dumps([
        {"video": "movie101_66.mp4", "duration": 6, "question": "Which colour first?", "candidates": ["blue", "red"],
         "answer": "red", "question_type": "plotQA"}]))
    (root / "mlvu" / "json" / "8_sub_scene.json").write_text(json.dumps([
        {"video": "subPlot_new_all_126.mp4", "duration": 6.0, "question": "Please describe the scene when the "
         "colour changes.", "answer": "The red screen turns blue.", "question_type": "subPlot",
         "scoring_points": ["red first", "blue after"]}]))
    (root / "mlvu" / "json" / "9_summary.json").write_text(json.dumps([
        {"video": "217.mp4", "duration": 6.0, "question": "Please summarize this video, including its main content.",
         "answer": "A red screen, then a blue one.", "question_type": "summary"}]))
    vid(root / "mlvu" / "video" / "1_plotQA" / "movie101_66.mp4")
    vid(root / "mlvu" / "video" / "8_sub_scene" / "subPlot_new_all_126.mp4")
    vid(root / "mlvu" / "video" / "9_summary" / "217.mp4")
    # MMVU (yale-nlp/MMVU: validation.json, videos/<Subject>/<n>.mp4 — every subject has a 0.mp4)
    (root / "mmvu").mkdir()
    hf = "https://huggingface.co/datasets/yale-nlp/MMVU/resolve/main/videos"
    (root / "mmvu" / "validation.json").write_text(json.dumps([
        {"id": "validation_0", "video": f"{hf}/Art/0.mp4", "youtube_url": "https://www.youtube.com/watch?v=VkqytRr85ao",
         "question_type": "open-ended", "metadata": {"subject": "Art", "textbook": "t", "knowledge": [],
                                                     "rationale": "r"},
         "question": "Name the first colour.", "choices": {"A": "", "B": "", "C": "", "D": "", "E": ""},
         "answer": "red"},
        {"id": "validation_1", "video": f"{hf}/Chemistry/0.mp4", "youtube_url": "https://www.youtube.com/watch?v=6H",
         "question_type": "multiple-choice", "metadata": {"subject": "Chemistry", "textbook": "t", "knowledge": [],
                                                          "rationale": "r"},
         "question": "Which colour first?", "choices": {"A": "red", "B": "blue", "C": "green", "D": "white",
                                                        "E": "black"}, "answer": "A"}]))
    vid(root / "mmvu" / "videos" / "Art" / "0.mp4")
    vid(root / "mmvu" / "videos" / "Chemistry" / "0.mp4")
    # Charades-STA (charades_sta_test.txt; videos as Charades_v1_480.zip unpacks them)
    (root / "charades").mkdir()
    (root / "charades" / "charades_sta_test.txt").write_text("3MSZA 3.0 6.0##the screen turns blue.\n")
    vid(root / "charades" / "Charades_v1_480" / "3MSZA.mp4")
    return root


NAMES = ["videomme", "videomme_sub", "longvideobench", "lvbench", "mlvu", "mmvu", "charades"]


def test_loaders(benches):
    from paravt_train.benchmarks import folder_of

    got = {n: load_benchmark(n, benches / folder_of(n)) for n in NAMES + ["mlvu_generation"]}
    assert [i.answer for i in got["videomme"]] == ["A", "B"] and got["videomme"][0].group == "short"
    sub = got["videomme_sub"][1].question
    assert sub.startswith("Subtitles: filler line number 0") and len(sub) > 4000
    assert "the last colour is blue" in sub  # nothing cut
    assert got["longvideobench"][0].answer == "A" and got["longvideobench"][0].options == ["A. red", "B. blue"]
    lv = got["lvbench"]
    assert lv[0].answer == "B" and lv[0].options == ["A. blue (the sky's)", "B. red (a rose's)"]  # "(" kept
    assert lv[0].question == "Which colour first?" and lv[0].video.endswith("videos/00000/000000000.mp4")
    assert lv[0].extra["groups"] == ["key information retrieval", "entity recognition"]
    assert lv[1].group == "temporal grounding" and lv[0].extra["video_type"] == "documentary"
    assert [i.answer for i in got["mlvu"]] == ["B"]  # the generation tasks are not multiple choice
    gen = got["mlvu_generation"]
    assert [(i.task, i.group) for i in gen] == [("oe", "subPlot"), ("oe", "summary")]
    assert gen[0].extra["scoring_points"] == ["red first", "blue after"] and Path(gen[1].video).is_file()
    mm = got["mmvu"]
    assert [i.task for i in mm] == ["oe", "mcq"] and mm[1].options[:2] == ["A. red", "B. blue"]
    assert mm[0].video != mm[1].video  # two subjects' 0.mp4 are two videos
    assert mm[0].video.endswith("videos/Art/0.mp4") and mm[1].video.endswith("videos/Chemistry/0.mp4")
    assert got["charades"][0].task == "tvg" and got["charades"][0].answer == "[3.0, 6.0]"
    assert "Charades_v1_480" in got["charades"][0].video


def test_missing_data_is_a_clear_message(tmp_path, benches):
    with pytest.raises(BenchmarkError, match="expected .*lvb_val.json"):
        load_benchmark("longvideobench", tmp_path)
    with pytest.raises(BenchmarkError, match="benchmark folder not found"):
        load_benchmark("mlvu", tmp_path / "nope")
    (tmp_path / "charades").mkdir()
    (tmp_path / "charades" / "charades_sta_test.txt").write_text("ZZ 1 2##x\n")
    with pytest.raises(BenchmarkError, match="videos missing, e.g. expected .*Charades_v1_480/ZZ.mp4"):
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
    assert len(items) == 11
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
    # LVBench per official category; a question with two categories counts in both
    assert "| lvbench | all | 2 | 100.0 |" in table and "| lvbench | entity recognition | 1 | 100.0 |" in table
    assert "| lvbench | key information retrieval | 1 |" in table and "| lvbench | temporal grounding | 1 |" in table


def test_spoiled_items_are_rerun_counted_apart_and_asked_again_on_resume(benches, tmp_path):
    """An item whose run the runtime spoiled is asked again ``reruns`` times; one that still fails is recorded as
    failed (an error, not a wrong answer) and a resumed run asks it again, leaving the answered ones alone."""
    from paravt_agent.errors import PolicyError

    items = load_benchmark("charades", benches / "charades") + load_benchmark("mmvu", benches / "mmvu")
    calls: list[str] = []
    down = {"on": True}

    def flaky(role, msgs):
        q = text_of(msgs[1]["content"])
        calls.append(q)
        if down["on"] and "[start, end]" in q:
            raise PolicyError("the endpoint is down")
        return oracle(role, msgs)

    agent = Agent(policy=ScriptedPolicy(flaky), config=AgentConfig(mode="none"))
    out = tmp_path / "r.jsonl"
    recs = run_eval(agent, items, out, progress=False, reruns=2)
    spoiled = [r for r in recs if r["failed"]]
    assert spoiled and all(r["benchmark"] == "charades" and r["tries"] == 3 for r in spoiled)
    assert all(not r["failed"] and r["tries"] == 1 for r in recs if r["benchmark"] == "mmvu")
    down["on"], calls[:] = False, []
    recs = run_eval(agent, items, out, progress=False, reruns=0)  # resume: only the failed items again
    assert len(calls) == len(spoiled) and all("[start, end]" in q for q in calls)
    assert all(not r["failed"] for r in recs) and len(recs) == len(items)
    # the failed records stay in the file; the new ones are taken
    assert len(out.read_text().splitlines()) == len(items) + len(spoiled)


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
    from paravt_train.eval.stats import mean_ci, paired_diff_ci

    assert mean_ci([0.5] * 10) == (0.5, 0.5, 0.5) and mean_ci([]) == (0.0, 0.0, 0.0)
    m, lo, hi = mean_ci([0, 1] * 20)
    assert m == 0.5 and 0.3 < lo < 0.5 < hi < 0.7
    gain = paired_diff_ci([0, 0, 0, 1] * 10, [1, 1, 0, 1] * 10)  # after - before: the gain is positive
    assert gain[0] == pytest.approx(0.5) and 0 < gain[1] < 0.5 < gain[2] <= 1
    with pytest.raises(ValueError, match="same questions"):
        paired_diff_ci([1, 0], [1])
