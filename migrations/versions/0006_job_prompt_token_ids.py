"""A job whose prompt was given as token ids keeps them, so the engine runs exactly those ids

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 05:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('prompt_token_ids', sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('prompt_token_ids')
