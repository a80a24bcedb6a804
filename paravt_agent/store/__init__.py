"""The trajectory store: every served trace and the feedback users give on it, in SQLite or PostgreSQL
(:mod:`~paravt_agent.store.trajectories`), and the checks a feedback row passes before it may become training data
(:mod:`~paravt_agent.store.feedback`: an answer the trace's question can have, a reward in range) — at write time
here, at read time by the online learner — and who each label counts for (:mod:`~paravt_agent.store.principals`:
the authenticated voter, never a name the caller sends)."""

from paravt_agent.store.feedback import MAX_ANSWER_CHARS, check_answer, check_reward, task_of
from paravt_agent.store.trajectories import (
    PostgresTrajectoryStore,
    SQLiteTrajectoryStore,
    TrajectoryStore,
    open_store,
)

__all__ = ["MAX_ANSWER_CHARS", "PostgresTrajectoryStore", "SQLiteTrajectoryStore", "TrajectoryStore", "check_answer",
           "check_reward", "open_store", "task_of"]
