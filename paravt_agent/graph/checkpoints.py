"""LangGraph checkpointers by name, for durable agent runs.

``memory`` (``InMemorySaver``: a process's own runs, what interrupts need), ``sqlite:///path.db``
(``sqlite:////abs/path.db`` or ``sqlite:///relative.db``; ``langgraph-checkpoint-sqlite``'s ``AsyncSqliteSaver``:
a run survives its process) and
``postgresql://…`` (``langgraph-checkpoint-postgres``'s ``AsyncPostgresSaver``: services). Any saver object
is used as it is. Install the savers with ``pip install 'paravt[durable]'``.
"""

from __future__ import annotations

from typing import Any

from paravt_agent.errors import ConfigError
from paravt_agent.graph import STATE_TYPES

__all__ = ["open_checkpointer", "serializer"]


def serializer():
    """LangGraph's serializer, allowed to rebuild exactly the state's own types (strict: a checkpoint cannot
    name any other class to construct)."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer


    return JsonPlusSerializer(allowed_msgpack_modules=[(t.__module__, t.__name__) for t in STATE_TYPES])


async def open_checkpointer(spec: Any):
    """A checkpointer from ``spec`` (a saver, ``"memory"``, a SQLite or PostgreSQL URL), opened in the running
    event loop (the async savers' connections belong to one loop). The savers made here use :func:`serializer`."""
    if not isinstance(spec, str):
        return spec
    if spec == "memory":
        from langgraph.checkpoint.memory import InMemorySaver

        return InMemorySaver(serde=serializer())
    if spec.startswith("sqlite:///"):
        try:
            import aiosqlite
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
        except ImportError as exc:
            raise ConfigError("a SQLite checkpointer needs langgraph-checkpoint-sqlite "
                              "(pip install 'paravt[durable]')") from exc
        conn = await aiosqlite.connect(spec[len("sqlite:///"):])  # sqlite:///rel.db, sqlite:////abs/path.db
        saver = AsyncSqliteSaver(conn, serde=serializer())
        await saver.setup()
        return saver
    if spec.startswith(("postgresql://", "postgres://")):
        try:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
            from psycopg import AsyncConnection
            from psycopg.rows import dict_row
        except ImportError as exc:
            raise ConfigError("a PostgreSQL checkpointer needs langgraph-checkpoint-postgres "
                              "(pip install 'paravt[durable]')") from exc
        conn = await AsyncConnection.connect(spec, autocommit=True, prepare_threshold=0, row_factory=dict_row)
        saver = AsyncPostgresSaver(conn, serde=serializer())
        await saver.setup()
        return saver
    raise ConfigError(f"unknown checkpointer {spec!r}: use 'memory', 'sqlite:///path.db', a postgresql:// URL "
                      "or a LangGraph saver object")
