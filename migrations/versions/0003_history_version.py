"""The job counts rewrites of its history.

A resumed attempt replaces the rows from its checkpoint's step on. ``history_version`` goes up
by one with each such rewrite and ``history_reset_step`` is the first step the latest one
replaced, so that a client holding rows of an earlier version knows what to drop.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE on both databases (SQLite has had ADD and DROP COLUMN since 3.35): a
# batch migration would rebuild the job table, and dropping the old one would cascade to the
# rollups and scale events that reference it.


def upgrade() -> None:
    op.add_column(
        "job", sa.Column("history_version", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("job", sa.Column("history_reset_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("job", "history_reset_step")
    op.drop_column("job", "history_version")
