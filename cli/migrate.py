"""Run the job store's Alembic migrations programmatically (CLI, tests, `pagedserve up`)."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

REPO_ROOT = Path(__file__).resolve().parent.parent


def alembic_config(database_url: str) -> Config:
    """An Alembic config for the repository's migrations pointed at database_url."""
    config = Config(str(REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


def unmigrated(database_url: str) -> str | None:
    """Why the job store at database_url cannot serve this code (its schema is not at the migrations' head), or
    None when it can or cannot be reached now (a store that is down is waited out, not refused)."""
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    engine = create_engine(database_url)
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(logging.WARNING)  # a look at the revision is no migration to announce
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    except OperationalError:
        return None
    finally:
        alembic_log.setLevel(level)
        engine.dispose()
    if current == head:
        return None
    return f"the job store is at revision {current or 'none'}, not {head}: run `pagedserve migrate` first"


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database up to revision."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Migrate the database down to revision."""
    command.downgrade(alembic_config(database_url), revision)
