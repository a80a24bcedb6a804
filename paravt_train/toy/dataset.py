"""``paravt-train toy-data``: the small data set the toy configs of ``examples/configs/`` train on.

One folder (``data/toy`` by default, the path those configs name) holds everything a trainer reads:

* ``videos/``: the toy worlds' mp4 files (training worlds from seed 0, held-out ones from
  :data:`~paravt_train.toy.build.TEST_SEED0`, so no held-out video is a training one);
* ``sft.parquet``: ParaVT traces of the training worlds (parallel, sequential and direct traces, sub-agent
  samples: :func:`~paravt_train.toy.rows.sft_rows`), what ``paravt-train sft`` reads;
* ``rl_train.parquet``, ``rl_heldout.parquet``: RL prompts of the training and the held-out worlds, what
  ``paravt-train grpo`` reads (``data`` and ``eval.data``);
* ``feedback.db``: a trajectory store with the training worlds' questions and a right answer for each from three
  users, what ``paravt-train online --store`` reads (as if users had labelled the served agent's answers).

Seconds on a CPU: no model is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paravt_agent.store import TrajectoryStore
from paravt_agent.trajectory import Trace
from paravt_train.data import write_parquet
from paravt_train.toy.build import TEST_SEED0
from paravt_train.toy.rows import rl_rows, sft_rows
from paravt_train.toy.world import make_worlds
from tools import ToolRegistry

__all__ = ["DEFAULT_FOLDER", "ToyData", "write_toy_data"]

#: where the toy configs (examples/configs/toy_*.yaml) expect the data, relative to the repository root
DEFAULT_FOLDER = Path("data/toy")
#: the users whose labels fill the feedback store (the online learner counts labels per user)
USERS = ("toy:alice", "toy:bob", "toy:carol")


@dataclass
class ToyData:
    """What :func:`write_toy_data` wrote."""

    folder: Path
    sft_rows: int
    rl_rows: int
    heldout_rows: int
    feedback_rows: int

    def report(self) -> str:
        f = self.folder
        return (f"wrote {f}: videos/, sft.parquet ({self.sft_rows} rows), rl_train.parquet ({self.rl_rows} prompts), "
                f"rl_heldout.parquet ({self.heldout_rows} prompts), feedback.db ({self.feedback_rows} labelled "
                f"answers from {len(USERS)} users)")


def write_toy_data(folder: str | Path = DEFAULT_FOLDER, worlds: int = 8, heldout: int = 4, seed: int = 0,
                   progress: bool = False) -> ToyData:
    """Write the toy data set into ``folder`` (see the module docstring); the same arguments write the same
    files. An existing feedback store is replaced, so the learner starts from the same labels."""
    folder = Path(folder)
    videos = folder / "videos"
    train = make_worlds(range(seed, seed + worlds), videos, progress, mcq=2, oe=1, tvg=1)
    held = make_worlds(range(TEST_SEED0 + seed, TEST_SEED0 + seed + heldout), videos, progress, mcq=2, oe=1, tvg=1)
    schema = ToolRegistry.default(entry_points_too=False).subset(["crop_video"]).schemas()
    sft = sft_rows(train, schema, seed=seed, video_root=videos)
    write_parquet(sft, folder / "sft.parquet")
    rl = rl_rows(train, videos)
    write_parquet(rl, folder / "rl_train.parquet")
    write_parquet(rl_rows(held, videos), folder / "rl_heldout.parquet")
    db = folder / "feedback.db"
    for stale in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        stale.unlink(missing_ok=True)
    store = TrajectoryStore(db)
    labelled = 0
    for w in train:
        for q in w.questions:
            trace = Trace(video=str(Path(w.video).resolve()), question=q.question, options=q.options)
            store.add(trace)
            store.feedback(trace.id, answer=q.answer, user=USERS[labelled % len(USERS)])
            labelled += 1
    return ToyData(folder, len(sft), len(rl), sum(len(w.questions) for w in held), labelled)
