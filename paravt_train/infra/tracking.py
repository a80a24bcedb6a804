"""A run's metrics: ``metrics.jsonl`` and the experiment trackers named in ``report_to``.

``report_to`` follows TRL's and verl's option of that name: ``tensorboard``, ``mlflow``, ``wandb``,
``trackio``, several at once, none by default. Rank 0 alone writes (every rank's numbers are gathered into
the step's record before it is logged). Each tracker receives the run's config once and every numeric metric
of every logged step, under the names and step numbers of ``metrics.jsonl`` (nested records, e.g. per-task
accuracy, flattened with ``/``). All four work offline:

- tensorboard: event files in ``OUTPUT_DIR/tensorboard`` (``tensorboard --logdir OUTPUT_DIR``).
- mlflow: ``MLFLOW_TRACKING_URI`` when set, else a SQLite store in ``OUTPUT_DIR/mlflow.db`` (MLflow 3's
  local default; its ``./mlruns`` file store is in maintenance mode and refused unless
  ``MLFLOW_ALLOW_FILE_STORE=true``): ``mlflow ui --backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db``;
  experiment ``MLFLOW_EXPERIMENT_NAME`` or ``paravt``.
- wandb: ``WANDB_PROJECT`` or ``paravt``, files in ``OUTPUT_DIR/wandb``; ``WANDB_MODE=offline`` keeps it local.
- trackio: project ``TRACKIO_PROJECT`` or ``paravt`` (trackio's local database; ``trackio show``).

A resumed run continues the same tracker runs (their ids are kept in ``OUTPUT_DIR/trackers.json``) from its
checkpoint's step; the steps after it that the crashed attempt had logged are logged again. TensorBoard drops
the old points (``purge_step``); MLflow and trackio keep both values of such a step (equal ones where the
resume is exact, as SFT's is); wandb, whose steps only increase, keeps the first.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

from paravt_agent.errors import ConfigError

__all__ = ["TRACKERS", "MetricsLog", "ReportTo", "flat_metrics", "parse_report_to"]

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
_INSTALL = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny sqlalchemy alembic", "wandb": "wandb",
            "trackio": "trackio"}


def parse_report_to(value) -> list[str]:
    """``None`` / ``"none"`` / ``"tensorboard,mlflow"`` / a list → the tracker names, checked, in order."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(n).strip().lower() for n in items if str(n).strip()]
    if names in (["none"], ["all"]):
        return [] if names == ["none"] else list(TRACKERS)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}: report_to takes {', '.join(TRACKERS)} (or none / all)")
    return list(dict.fromkeys(names))


#: a config field's type for ``report_to``: a list, ``"tensorboard,mlflow"``, ``"none"`` or ``"all"``, checked
ReportTo = Annotated[list[str], BeforeValidator(parse_report_to)]


def flat_metrics(rec: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a metrics record, nested keys joined with ``/`` (``step`` and ``time`` are the
    step and the wall clock, not metrics; strings, lists and non-finite numbers are left out)."""
    out: dict[str, float] = {}
    for key, value in rec.items():
        name = f"{prefix}{key}"
        if not prefix and key in ("step", "time"):
            continue
        if isinstance(value, dict):
            out.update(flat_metrics(value, name + "/"))
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def _flat_config(cfg: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            out.update(_flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class _TensorBoard:
    def __init__(self, out: Path, config: dict, run_name: str, state: dict, purge: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # ``purge``: the first step this attempt logs; the points an earlier attempt logged from there on (a
        # crashed run's steps after its checkpoint, or all of them on a fresh start) are dropped by readers
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)
        if not state.get("config_logged"):
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)
            state["config_logged"] = True

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crash loses no logged step

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, out: Path, config: dict, run_name: str, state: dict, purge: int | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = state.get("run_id")
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "paravt")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            params = [Param(k, v[:6000]) for k, v in sorted(_flat_config(config).items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            state["run_id"] = self.run_id
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's per-batch metric limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    def __init__(self, out: Path, config: dict, run_name: str, state: dict, purge: int | None):
        import wandb

        state.setdefault("run_id", wandb.util.generate_id())
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "paravt"), name=run_name, config=config,
                              dir=str(out), id=state["run_id"], resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, out: Path, config: dict, run_name: str, state: dict, purge: int | None):
        import trackio

        self.trackio = trackio
        resume = "allow" if "run_name" in state else "never"  # a fresh start is a new run, never an old one's
        state.setdefault("run_name", f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "paravt"), name=state["run_name"], config=config,
                     resume=resume)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


def _step_of(line: str) -> int | None:
    """A metrics.jsonl line's step; None for a line a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


_CLASSES = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb, "trackio": _Trackio}


class MetricsLog:
    """``OUTPUT_DIR/metrics.jsonl`` plus the ``report_to`` trackers; on rank 0 only (other ranks: no-ops).

    ``config`` (the run's settings, JSON-able) is given to each tracker once per run; ``run_name`` defaults to
    the output folder's name. :meth:`start` begins logging (fresh or resumed), :meth:`close` ends it."""

    def __init__(self, out: str | Path, report_to=(), config: dict | None = None, run_name: str | None = None,
                 rank: int = 0):
        self.out = Path(out)
        self.path = self.out / "metrics.jsonl"
        self.rank = rank
        self.names = parse_report_to(report_to)
        self.config = json.loads(json.dumps(config or {}, default=str))
        self.run_name = run_name or self.out.resolve().name
        self.trackers: dict[str, object] = {}
        self._purge: int | None = None  # the first step of this attempt, for the trackers opened by start()

    def start(self, step: int = 0) -> MetricsLog:
        """Opens the trackers for a run at ``step``: 0 is a fresh start (an earlier attempt's metrics.jsonl
        and tracker runs are dropped), a resumed step keeps the lines up to it (the later ones will be redone)
        and continues the same tracker runs."""
        if self.rank != 0:
            return self
        if step == 0:
            self.path.unlink(missing_ok=True)
            (self.out / "trackers.json").unlink(missing_ok=True)
        elif self.path.is_file():
            keep = [ln for ln in self.path.read_text().splitlines()
                    if _step_of(ln) is not None and _step_of(ln) <= step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self._purge = step + 1
        self._open()
        self._purge = None  # reopened after close(), the trackers drop nothing
        return self

    def _open(self) -> None:
        """Starts (or, after :meth:`close` or on a resumed run, continues) each tracker's run."""
        if self.rank != 0 or not self.names:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        state_path = self.out / "trackers.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        for tracker in self.names:
            try:
                self.trackers[tracker] = _CLASSES[tracker](self.out, self.config, self.run_name,
                                                           state.setdefault(tracker, {}), self._purge)
            except ImportError as exc:
                self.close()
                raise ConfigError(f"report_to {tracker} needs {_INSTALL[tracker]}: pip install {_INSTALL[tracker]} "
                                  "(or pip install 'paravt[tracking]')") from exc
        state_path.write_text(json.dumps(state, indent=1))

    def log(self, rec: dict) -> None:
        """One step's record: a line of metrics.jsonl, and its numbers to every tracker at ``rec['step']``."""
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.names and not self.trackers:  # logging again after close(): the same runs go on
            self._open()
        if self.trackers:
            metrics, step = flat_metrics(rec), int(rec["step"])
            for tracker in self.trackers.values():
                tracker.log(metrics, step)

    def log_event(self, metrics: dict, step: int) -> None:
        """Numbers that are not a step's line (an online gate, a promotion) to every tracker at ``step``."""
        if self.rank != 0 or not self.names:
            return
        if not self.trackers:
            self._open()
        for tracker in self.trackers.values():
            tracker.log(flat_metrics(metrics), int(step))

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}
