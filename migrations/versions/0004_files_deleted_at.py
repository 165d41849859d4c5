"""Deleted files keep their row (batches name them) with deleted_at set and no content

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 05:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')
