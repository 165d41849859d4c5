"""Per-key webhook signing secrets; webhook deliveries claimed through next_attempt_at

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 04:30:00.000000
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('webhook_secret', sa.String(length=64), nullable=True))
    # Existing keys get a fresh secret nobody has seen: `pagedserve keys rotate KEY_ID` shows a new one.
    api_keys = sa.table('api_keys', sa.column('id', sa.String), sa.column('webhook_secret', sa.String))
    connection = op.get_bind()
    for (key_id,) in connection.execute(sa.select(api_keys.c.id)).all():
        connection.execute(api_keys.update().where(api_keys.c.id == key_id)
                           .values(webhook_secret=f"whsec_{secrets.token_urlsafe(32)}"))
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.alter_column('webhook_secret', existing_type=sa.String(length=64), nullable=False)
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.add_column(sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_column('next_attempt_at')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('webhook_secret')
