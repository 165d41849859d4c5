"""Database engines and sessions for the job store (PostgreSQL or SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.settings import get_settings


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while a worker writes; busy_timeout makes writers queue instead of failing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


@lru_cache(maxsize=8)
def engine_for(url: str, pool_size: int, max_overflow: int) -> Engine:
    """One SQLAlchemy engine per database URL and pool size per process."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=pool_size, max_overflow=max_overflow)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)


def session_factory() -> sessionmaker[Session]:
    """A session maker bound to the configured job store."""
    settings = get_settings()
    return _sessionmaker(settings.resolved_database_url(), settings.database_pool_size,
                         settings.database_max_overflow)


@lru_cache(maxsize=8)
def _sessionmaker(url: str, pool_size: int, max_overflow: int) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url, pool_size, max_overflow), expire_on_commit=False)


def get_session() -> Iterator[Session]:
    """FastAPI dependency: one session per request, closed afterwards."""
    with session_factory()() as session:
        yield session
