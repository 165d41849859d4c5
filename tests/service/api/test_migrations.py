"""The job store's migrations upgrade and downgrade cleanly and match the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from cli import migrate
from core.models import Base

TABLES = {"api_keys", "jobs", "webhook_deliveries", "webhook_attempts", "files", "batches", "batch_requests"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(database_url: str) -> None:
    migrate.upgrade(database_url)
    assert _tables(database_url) == TABLES
    migrate.downgrade(database_url)
    assert _tables(database_url) == set()
    migrate.upgrade(database_url)
    assert _tables(database_url) == TABLES


def test_migrated_schema_matches_the_models(database_url: str) -> None:
    migrate.upgrade(database_url)
    engine = create_engine(database_url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert diff == []
