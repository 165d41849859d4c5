"""A job records how many of its prompt's tokens the engine's prefix cache served (OpenAI's cached_tokens)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 04:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cached_prompt_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('cached_prompt_tokens')
