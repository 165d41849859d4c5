"""An API key may have its own priority floor: the most urgent priority its jobs run at

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 23:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('priority_floor', sa.Integer(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('priority_floor')
