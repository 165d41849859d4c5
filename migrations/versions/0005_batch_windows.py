"""Batches keep OpenAI's completion window and states: expires_at, finalizing_at, expired_at; a job's batch is indexed

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 05:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

NEW_TIMESTAMPS = ('expires_at', 'finalizing_at', 'expired_at')


def upgrade() -> None:
    """Apply this revision."""
    # the status column is a VARCHAR(16) without a CHECK, so the new states (validating, finalizing, expired)
    # need no DDL
    with op.batch_alter_table('batches', schema=None) as batch_op:
        for column in NEW_TIMESTAMPS:
            batch_op.add_column(sa.Column(column, sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.create_index('ix_batch_requests_job_id', ['job_id'], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.drop_index('ix_batch_requests_job_id')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        for column in reversed(NEW_TIMESTAMPS):
            batch_op.drop_column(column)
