"""Data formats: SFT and RL Parquet files (and the Hugging Face datasets layout of the same columns).

SFT row: ``messages`` — the chat, stored as a JSON string (paper, Appendix B) —
plus optional ``id``. RL row: ``prompt`` (messages, JSON string), ``videos``,
``answer``, ``question_type`` (``mcq`` | ``tvg`` | ``oe``), ``options``.

Message content is a string or a list of parts::
    {"type": "text", "text": ...}
    {"type": "video", "video": "rel/or/abs.mp4"}                       # the overview
    {"type": "video", "video": "...", "start": 12.0, "end": 20.0}      # a crop (sub-agent input)
    {"type": "video", "video": "...", "n_frames": 8}                   # an overview of exactly n frames
    {"type": "video", "video": "...", "start": 3.0, "end": 4.0, "head": false}  # a crop's labelled frames alone
                                                                       # (a model-backed tool's prompt)

An assistant message may carry ``"train": false``: it stays in the context and
out of the loss (e.g. the planner turn of an answer-step-only sample).

Video parts are turned into ``<t seconds>`` labelled frames by the same code the
agent runs (:mod:`paravt_agent.prompts`, :mod:`paravt_agent.video`), so training
and serving see identical inputs. Videos are resolved against ``video_root``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, ValidationError, field_validator, model_validator

from paravt_agent.errors import ConfigError, VideoError
from paravt_agent.prompts import frame_parts, overview_parts, window_parts
from paravt_agent.protocol import parse_span
from paravt_agent.video import FrameConfig, VideoReader, check_window
from paravt_train.data.records import PromptItem

__all__ = [
    "DataError",
    "Message",
    "RLSample",
    "SFTSample",
    "check_renderable",
    "detect_kind",
    "group_errors",
    "iter_rows",
    "load_rl",
    "load_sft",
    "prompts_from_rl",
    "render_messages",
    "resolve_video",
    "validate_file",
    "write_parquet",
]


class DataError(ConfigError):
    """A data file or row is invalid; the message names the row and the reason."""


class Part(BaseModel):
    type: Literal["text", "video", "image"]
    text: str | None = None
    video: str | None = None
    start: float | None = None
    end: float | None = None
    n_frames: int | None = Field(None, ge=1)
    # a crop's "Window a-b seconds, N frames." line; False: its labelled frames alone (a tool's prompt)
    head: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        if self.type == "video":
            if not self.video:
                raise ValueError("a video part needs 'video' (a path)")
            if (self.start is None) != (self.end is None):
                raise ValueError("a crop needs both 'start' and 'end'")
            if self.start is not None and not 0 <= self.start < self.end:
                raise ValueError(f"crop window [{self.start}, {self.end}] needs 0 <= start < end")
        return self


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Part]
    train: bool = Field(True, description="Assistant turns only: False keeps the turn as context, out of the loss.")


def _parse_messages(v):
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
    if hasattr(v, "tolist"):
        v = v.tolist()
    return v


class SFTSample(BaseModel):
    id: str | None = None
    messages: list[Message]

    _m = field_validator("messages", mode="before")(classmethod(lambda cls, v: _parse_messages(v)))

    @model_validator(mode="after")
    def _check(self):
        roles = [m.role for m in self.messages]
        if "assistant" not in roles:
            raise ValueError("no assistant turn to train on")
        if roles[-1] != "assistant":
            raise ValueError("the last turn must be the assistant's")
        if not any(m.train for m in self.messages if m.role == "assistant"):
            raise ValueError("every assistant turn has train: false; nothing to train on")
        return self


class RLSample(BaseModel):
    """One RL prompt row. The task column is ``question_type`` in the files (the paper's name) and ``task``
    in code: ``mcq`` (exact letter), ``tvg`` (temporal IoU), ``oe`` (token F1)."""

    id: str | None = None
    prompt: list[Message]
    videos: list[str] = Field(default_factory=list)
    answer: str
    task: Literal["mcq", "tvg", "oe"] = Field(validation_alias=AliasChoices("question_type", "task"),
                                              serialization_alias="question_type")
    options: list[str] | None = None
    question: str | None = None

    _p = field_validator("prompt", mode="before")(classmethod(lambda cls, v: _parse_messages(v)))

    @field_validator("videos", "options", mode="before")
    @classmethod
    def _arrays(cls, v):
        if isinstance(v, str):
            v = json.loads(v)
        return v.tolist() if hasattr(v, "tolist") else v

    @field_validator("answer", mode="before")
    @classmethod
    def _answer(cls, v):
        return json.dumps(v) if isinstance(v, list | tuple) else str(v)

    @model_validator(mode="after")
    def _check(self):
        if not self.answer.strip():
            raise ValueError("empty answer")
        if self.task == "mcq" and not self.options:
            raise ValueError("an mcq sample needs options")
        if self.task == "tvg" and parse_span(self.answer) is None:
            raise ValueError(f"tvg answer {self.answer!r} is not a span [start, end]")
        if self.prompt[-1].role != "user":
            raise ValueError("the prompt must end with the user's turn")
        return self

    @property
    def answer_value(self):
        """The answer as the reward wants it: a [start, end] list for tvg, else the string."""
        if self.task == "tvg":
            return list(parse_span(self.answer))
        return self.answer

    def question_text(self) -> str:
        if self.question:
            return self.question
        content = self.prompt[-1].content
        if isinstance(content, str):
            return content
        return " ".join(p.text for p in content if p.type == "text" and p.text)


# --------------------------------------------------------------------------- files


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():  # HF datasets layout: data/<split>-0000x-of-0000y.parquet (or any *.parquet below)
        files = sorted(path.rglob("*.parquet"))
        if files:
            return files
    raise DataError(f"{path}: no Parquet file found (expected a .parquet file or a dataset directory)")


def iter_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(row number, row dict)`` over one Parquet file or a dataset directory."""
    import pyarrow.parquet as pq

    n = 0
    for f in _parquet_files(Path(path)):
        try:
            table = pq.read_table(f)
        except Exception as exc:  # pyarrow raises several types for non-Parquet input
            raise DataError(f"{f}: not a readable Parquet file ({exc})") from None
        for row in table.to_pylist():
            yield n, row
            n += 1


def _row_error(exc: ValidationError) -> str:
    """A row's errors; a column the row lacks is said as such (so equal reasons group: :func:`group_errors`)."""
    return "; ".join(f"column `{e['loc'][0]}` is missing" if e["type"] == "missing" and len(e["loc"]) == 1 else
                     f"{'.'.join(str(x) for x in e['loc']) or 'row'}: {e['msg'].removeprefix('Value error, ')}"
                     for e in exc.errors())


def _load(path, model, video_root, check_videos):
    out, rows, errors = [], [], []
    for i, row in iter_rows(path):
        try:
            sample = model.model_validate(row)
        except ValidationError as exc:
            errors.append((i, _row_error(exc)))
            continue
        if check_videos:
            missing = [v for v in _videos_of(sample) if not resolve_video(v, video_root).is_file()]
            if missing:
                errors.append((i, f"video not found: {resolve_video(missing[0], video_root)}"))
                continue
        out.append(sample)
        rows.append(i)
    if check_videos and out:  # what rendering would hit: files that are not videos, crops outside a video
        bad = dict(check_renderable(out, video_root))
        errors.extend((rows[k], why) for k, why in bad.items())
        out = [x for k, x in enumerate(out) if k not in bad]
        errors.sort()
    return out, errors


def _videos_of(sample) -> list[str]:
    msgs = sample.messages if isinstance(sample, SFTSample) else sample.prompt
    vids = [p.video for m in msgs if not isinstance(m.content, str) for p in m.content if p.type == "video"]
    if isinstance(sample, RLSample):
        vids += sample.videos
    return list(dict.fromkeys(vids))


#: the columns that say which kind a data file is
KIND_COLUMNS = {"sft": ("messages",), "rl": ("prompt", "answer")}


def detect_kind(path) -> str | None:
    """``sft`` or ``rl`` by the file's columns (``messages``; ``prompt`` and ``answer``), None when neither."""
    import pyarrow.parquet as pq

    try:
        columns = set(pq.read_schema(_parquet_files(Path(path))[0]).names)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    found = [k for k, need in KIND_COLUMNS.items() if set(need) <= columns]
    return found[0] if len(found) == 1 else None


def validate_file(path, kind: str = "auto", video_root: str | Path | None = None, check_videos: bool = True):
    """``(valid samples, [(row, reason), ...])``: every bad row with its number, nothing silently skipped. ``kind``
    ``auto`` reads the file's columns (:func:`detect_kind`); a kind the columns contradict is refused, naming the
    other (``--kind rl``)."""
    seen = detect_kind(path)
    if kind == "auto":
        if seen is None:
            raise DataError(f"{path}: neither SFT rows (a `messages` column) nor RL rows (`prompt` and `answer` "
                            "columns); docs/training.md has both formats")
        kind = seen
    model = {"sft": SFTSample, "rl": RLSample}.get(kind)
    if model is None:
        raise DataError(f"unknown data kind {kind!r}; expected auto, sft or rl")
    if seen is not None and seen != kind:
        columns = ", ".join(KIND_COLUMNS[seen])
        raise DataError(f"{path} holds {seen.upper()} rows (columns {columns}), not {kind.upper()} rows: check it "
                        f"with `paravt-train validate-data {path} --kind {seen}`")
    return _load(path, model, video_root, check_videos)


def group_errors(errors: list[tuple[int, str]]) -> list[str]:
    """One line per distinct reason, with its rows and their count ("rows 0-31 (32 rows): messages: field required"),
    in the order of their first row."""
    rows: dict[str, list[int]] = {}
    for i, why in errors:
        rows.setdefault(why, []).append(i)

    def span(ns: list[int]) -> str:
        if len(ns) == 1:
            return f"row {ns[0]}"
        runs, start = [], ns[0]
        for a, b in zip(ns, [*ns[1:], None], strict=True):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        shown = ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "")
        return f"rows {shown} ({len(ns)} rows)"

    return [f"{span(ns)}: {why}" for why, ns in rows.items()]


def _strict(path, kind, video_root, check_videos):
    samples, errors = validate_file(path, kind, video_root, check_videos)
    if errors:
        lines = group_errors(errors)
        shown = "\n".join(f"  {line}" for line in lines[:10])
        more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        raise DataError(f"{path}: {len(errors)} invalid rows (check them with `paravt-train validate-data {path} "
                        f"--kind {kind}`):\n{shown}{more}")
    return samples


def load_sft(path, video_root=None, check_videos: bool = True) -> list[SFTSample]:
    """All rows of an SFT file; raises :class:`DataError` listing bad rows before any training starts."""
    return _strict(path, "sft", video_root, check_videos)


def load_rl(path, video_root=None, check_videos: bool = True) -> list[RLSample]:
    return _strict(path, "rl", video_root, check_videos)


def check_renderable(samples, video_root: str | Path | None = None) -> list[tuple[int, str]]:
    """``[(row, reason), ...]`` for rows that would fail to render: a video part whose file is not a
    readable video, or a crop window outside its video. Opens each video once (no frames decoded)."""

    infos: dict[str, object] = {}
    bad = []
    for i, sample in enumerate(samples):
        msgs = sample.messages if isinstance(sample, SFTSample) else sample.prompt
        for m in msgs:
            if isinstance(m.content, str):
                continue
            problem = None
            for p in m.content:
                if p.type != "video":
                    continue
                path = str(resolve_video(p.video, video_root))
                try:
                    if path not in infos:
                        infos[path] = VideoReader(path).info
                    info = infos[path]
                    if p.start is not None:
                        check_window(p.start, p.end, info.duration)
                except VideoError as exc:
                    problem = str(exc)
                    infos.setdefault(path, None)
                    break
                except TypeError:  # the file failed to open earlier
                    problem = f"{path}: not a readable video"
                    break
            if problem:
                bad.append((i, problem))
                break
    return bad


def prompts_from_rl(path, video_root=None, limit: int | None = None) -> list:
    """RL rows → :class:`~paravt_train.data.records.PromptItem` s (the first video of each row; ids default to the
    row number)."""

    out = []
    for i, s in enumerate(load_rl(path, video_root)):
        if not s.videos:
            raise DataError(f"{path}: row {i} has no video")
        out.append(PromptItem(id=s.id or f"row{i}", video=str(resolve_video(s.videos[0], video_root)),
                              question=s.question_text(),
                              options=s.options, answer=s.answer_value, task=s.task))
    return out[:limit] if limit else out


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows; ``messages`` / ``prompt`` lists are stored as JSON strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    enc = []
    for r in rows:
        r = dict(r)
        for key in ("messages", "prompt"):
            if key in r and not isinstance(r[key], str):
                r[key] = json.dumps(r[key], ensure_ascii=False)
        enc.append(r)
    pq.write_table(pa.Table.from_pylist(enc), path)
    return path


# --------------------------------------------------------------------------- rendering


def resolve_video(video: str, video_root: str | Path | None) -> Path:
    p = Path(video)
    return p if p.is_absolute() or video_root is None else Path(video_root) / p


def render_messages(
    messages: list[Message], video_root: str | Path | None = None, frames: FrameConfig | None = None
) -> list[dict]:
    """Messages in the agent's neutral layout: video parts become labelled frames, exactly as the agent builds them."""

    f = frames or FrameConfig()
    out = []
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content, **({} if m.train else {"train": False})})
            continue
        parts: list[dict] = []
        for p in m.content:
            if p.type == "text":
                parts.append({"type": "text", "text": p.text})
                continue
            path = resolve_video(p.video, video_root)
            reader = VideoReader(path, backend=f.backend)
            if p.start is not None:
                end = min(p.end, reader.info.duration)
                clip = reader.crop(p.start, end, f)
                parts.extend(window_parts(clip.frames, clip.timestamps, (p.start, end)) if p.head
                             else frame_parts(clip.frames, clip.timestamps))
            else:
                clip = reader.overview(p.n_frames, f)
                parts.extend(overview_parts(clip.frames, clip.timestamps, clip.info.duration, path.name))
        out.append({"role": m.role, "content": parts})
    return out
