"""Local lmms-eval tasks over toy videos (no hub): ``paravt-lmms task --out DIR`` writes them.

Two tasks on the same held-out colour-at-t questions (``test.jsonl``, videos in ``videos/``):

- ``paravt_toy``: the question and its lettered options (which the plugin gives the agent as options, laid out
  in ParaVT's own protocol), the reply's letter read by lmms-eval's MCQ extractor (``extract_mcq_answer``),
  accuracy averaged by lmms-eval.
- ``paravt_toy_videomme``: the same questions as Video-MME rows, with Video-MME's own task functions:
  its prompt (``videomme_doc_to_text``), its answer parsing and scoring (``videomme_process_results``) and
  its aggregation (the perception score, in percent). What ``--tasks videomme`` does, on toy videos.

The YAML files name the data by absolute path, so the folder works from any directory. The functions below
are what the YAML's ``!function`` entries name (this module imports lmms-eval only inside them).
"""

from __future__ import annotations

import json
from pathlib import Path

from paravt_agent.protocol import labelled_options
from paravt_train.toy.build import TEST_SEED0
from paravt_train.toy.world import make_worlds

__all__ = ["doc_to_text", "doc_to_visual", "process_results", "write_toy_task"]

#: Video-MME's categories for the toy rows (its aggregation counts answers per category, so the names must be
#: among Video-MME's own; the toy's are a colour-at-t perception question on a short video)
VIDEOMME_ROW = {"duration": "short", "domain": "Life Record", "sub_category": "Daily Life",
                "task_type": "Attribute Perception"}

#: what both tasks share: the rows of test.jsonl, the video by path; {name}, {data} and the task's own lines fill it
TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function paravt_lmms.toy_task.doc_to_visual
doc_to_target: answer
{own}metadata:
  - version: 0.0
"""

TOY_OWN = """\
doc_to_text: !function paravt_lmms.toy_task.doc_to_text
process_results: !function paravt_lmms.toy_task.process_results
metric_list:
  - metric: accuracy
    aggregation: mean
    higher_is_better: true
"""

VIDEOMME_OWN = """\
doc_to_text: !function lmms_eval.tasks.videomme.utils.videomme_doc_to_text
process_results: !function lmms_eval.tasks.videomme.utils.videomme_process_results
metric_list:
  - metric: videomme_perception_score
    aggregation: !function lmms_eval.tasks.videomme.utils.videomme_aggregate_results
    higher_is_better: true
lmms_eval_specific_kwargs:
  default:
    pre_prompt: ""
    post_prompt: "\\nAnswer with the option's letter from the given choices directly."
"""


def doc_to_visual(doc) -> list[str]:
    return [doc["video"]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None) -> str:
    """The question and its lettered options, one per line: the plugin hands them to the agent as a question
    with options, which it lays out in its own protocol."""
    return "\n".join([doc["question"], *labelled_options(doc["choices"])])


def process_results(doc, results) -> dict:
    from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer

    letters = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"accuracy": float(extract_mcq_answer(results[0], choices=letters) == doc["answer"])}


def write_toy_task(out: str | Path, worlds: int = 4, seed0: int | None = None, progress: bool = False) -> Path:
    """Held-out toy videos, their colour-at-t MCQ rows (``test.jsonl``) and the two task YAMLs in ``out``;
    returns ``out``."""

    out = Path(out).resolve()
    start = TEST_SEED0 if seed0 is None else seed0
    rows = []
    for w in make_worlds(range(start, start + worlds), out / "videos", progress, mcq=3, oe=0, tvg=0):
        for i, q in enumerate(x for x in w.questions if x.task == "mcq"):
            rows.append({
                "question_id": f"{w.wid}-{i}", "videoID": w.wid, "video": str(Path(w.video).resolve()),
                "question": q.question, "choices": list(q.options), "answer": q.answer,
                # Video-MME's fields: options as "A. text" lines, its category columns
                "options": labelled_options(q.options), **VIDEOMME_ROW})
    out.mkdir(parents=True, exist_ok=True)
    data = out / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, own in (("paravt_toy", TOY_OWN), ("paravt_toy_videomme", VIDEOMME_OWN)):
        (out / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=json.dumps(str(data)), own=own))
    return out
