"""The ``paravt`` lmms-eval model: each ``generate_until`` request is one question to the ParaVT agent.

The request's context (the task's own prompt, instructions included) is the question, its option lines the
question's options (``options=auto``); its visual (``doc_to_visual``) is the video. The reply is the agent's
answer (the ``<answer>`` body), or for a question with options the letter of the option it chose (an answer
written as the option's text counts, as ``paravt-train eval`` scores it); the task's own ``process_results``
parses and scores the reply. The agent's turns use their own sampling and token
budgets (the model's agent config): a task's ``generation_kwargs`` (e.g. ``max_new_tokens: 16``) would cut the
planner's reasoning and tool calls, so they are not applied.

``--model_args`` (comma-separated ``key=value``):

- ``model``: a model directory (local, sglang) or the served model's name (openai); default: the toy policy.
- ``backend``: ``local`` | ``openai`` | ``sglang`` | a plugin backend; ``endpoint``: its URL.
- ``preset`` / ``config`` (an AgentConfig YAML) / ``mode`` (parallel, sequential, none) / ``n_frames``.
- ``options``: ``auto`` (default): a block of lettered option lines in the prompt (``A. ...``, ``B. ...``, with an
  ``Options:`` line above it) is given to the agent as the question's options, so its MCQ protocol applies
  (the options in its layout, a letter answer); the rest of the prompt, the task's instructions included, is
  the question. ``none``: the prompt verbatim, as an open question.
- ``concurrency``: questions in flight at once (default 8; lmms-eval's ``--batch_size`` when larger).
- ``reruns``: a question the runtime spoiled (a sub-agent timed out, a model call failed: the answer's status is
  not ``ok`` for the runtime's reasons) is asked again up to this many times (default 1). One that still fails
  is not passed off as the model's answer: its reply is empty (the task scores it as wrong) and the error rate
  per task is printed at the end of each request batch and written with the traces; ``on_failure=raise`` stops
  the evaluation instead.
- ``trace_dir``: where the per-sample traces go (``<date>_<task>.jsonl``, one per task and run); default
  ``<--output_path>/paravt_traces`` when ``--output_path`` is on lmms-eval's command line, else none.

Run lmms-eval as one process: the agent answers ``concurrency`` questions at once and its backend spreads
the model calls (``paravt serve --dp N`` behind the router); under ``accelerate``/``torchrun`` it refuses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms

from paravt_agent.agent import Agent
from paravt_agent.config import resolve_agent_config
from paravt_agent.defaults import resolve_model
from paravt_agent.errors import ConfigError
from paravt_agent.protocol import split_options


def _output_path_from_argv(argv: list[str]) -> str | None:
    """lmms-eval's ``--output_path`` (the model is built inside its CLI and is not told where results go)."""
    for i, arg in enumerate(argv):
        if arg == "--output_path" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--output_path="):
            return arg.split("=", 1)[1]
    return None


class ParaVT(lmms):
    """The ParaVT agent behind lmms-eval's model interface (``generate_until`` only)."""

    def __init__(self, model: str | None = None, backend: str = "local", endpoint: str | None = None,
                 preset: str | None = None, config: str | None = None, mode: str | None = None,
                 n_frames: int | None = None, options: str = "auto", concurrency: int = 8, api_key: str | None = None,
                 trace_dir: str | None = None, batch_size: int | str = 1, reruns: int = 1, on_failure: str = "empty",
                 **unused) -> None:
        super().__init__()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("run lmms-eval --model paravt as one process (not under accelerate/torchrun): the "
                              "agent answers `concurrency` questions at once and its backend spreads the model "
                              "calls (paravt serve --dp N)")
        unused.pop("device", None)  # lmms-eval passes its device; the backend chooses its own
        if unused:
            raise ConfigError(f"unknown paravt model_args: {sorted(unused)} (see paravt_lmms/models/paravt.py)")
        overrides = [f"mode={mode}"] if mode else []
        model = resolve_model(backend, model)
        cfg = resolve_agent_config(config, model if backend != "openai" else None, overrides, preset=preset)
        self.agent = Agent(model=model, backend=backend, endpoint=endpoint, config=cfg, api_key=api_key)
        if options not in ("auto", "none"):
            raise ConfigError(f"options={options!r}: auto or none")
        if on_failure not in ("empty", "raise"):
            raise ConfigError(f"on_failure={on_failure!r}: empty or raise")
        self.reruns, self.on_failure = int(reruns), on_failure
        self.options = options
        self.n_frames = int(n_frames) if n_frames else None
        self.concurrency = max(int(concurrency), int(batch_size) if str(batch_size).isdigit() else 1)
        out = trace_dir or (os.path.join(p, "paravt_traces") if (p := _output_path_from_argv(sys.argv)) else None)
        self.trace_dir = Path(out) if out else None
        self.run_stamp = time.strftime("%Y%m%d_%H%M%S")  # one trace file per task and run, as lmms-eval's own

    def _item(self, request: Instance) -> dict:
        context, _gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        visuals = visuals if isinstance(visuals, list | tuple) else [visuals]
        videos = [v for v in visuals if isinstance(v, str | os.PathLike)]
        if len(videos) != 1:
            raise ConfigError(f"{task} doc {doc_id}: ParaVT answers about one video; doc_to_visual gave "
                              f"{[type(v).__name__ for v in visuals]}")
        question, opts = split_options(context, anywhere=True) if self.options == "auto" else (context, None)
        return {"video": os.fspath(videos[0]), "question": question, "options": opts, "n_frames": self.n_frames,
                "task": task, "doc_id": doc_id}

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        items = [self._item(r) for r in requests]
        answers = self.agent.run(self.agent.aanswer_many(items, concurrency=self.concurrency,
                                                         progress=self.rank == 0, desc="paravt", reruns=self.reruns))
        if self.trace_dir is not None:
            self._write_traces(items, answers)
        failed: dict[str, list[int]] = {}
        for item, ans in zip(items, answers, strict=True):
            failed.setdefault(item["task"], [0, 0])[1] += 1
            failed[item["task"]][0] += not ans.trace.scorable
        for task, (bad, total) in failed.items():
            if bad:
                print(f"paravt: {task}: {bad} of {total} questions failed in the runtime after {self.reruns} "
                      f"rerun(s) (error rate {bad / total:.1%}); their replies are empty, scored as wrong by the "
                      "task", file=sys.stderr)
        if self.on_failure == "raise" and any(bad for bad, _ in failed.values()):
            first = next(a for a in answers if not a.trace.scorable)
            raise ConfigError("on_failure=raise: questions failed in the runtime, e.g. "
                              + "; ".join(first.trace.run_errors[:3]))
        out = []
        for req, item, ans in zip(requests, items, answers, strict=True):
            tr = ans.trace
            reply = ans.choice if item["options"] and ans.choice else ans.text
            if not tr.scorable:  # built on failed work: never passed off as the model's answer
                reply = ""
            self.cache_hook.add_partial("generate_until", (req.args[0], req.args[1]), reply)
            out.append(GenerationResult(text=reply, token_counts=TokenCounts(
                input_tokens=tr.prompt_tokens, output_tokens=tr.completion_tokens)))
        return out

    def _write_traces(self, items: list[dict], answers) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        by_task: dict[str, list[str]] = {}
        for item, ans in zip(items, answers, strict=True):
            rec = {"task": item["task"], "doc_id": item["doc_id"], "video": item["video"], "answer": ans.text,
                   "choice": ans.choice,
                   "ok": ans.trace.ok, "status": ans.trace.status, "failed": not ans.trace.scorable,
                   "trace": ans.trace.model_dump(mode="json")}
            by_task.setdefault(item["task"], []).append(json.dumps(rec, ensure_ascii=False))
        for task, lines in by_task.items():
            with (self.trace_dir / f"{self.run_stamp}_{task}.jsonl").open("a") as f:
                f.write("".join(line + "\n" for line in lines))

    def loglikelihood(self, requests):
        raise NotImplementedError("ParaVT is an agent that answers in text: generate_until tasks only")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("ParaVT answers one question per request: generate_until tasks only")
