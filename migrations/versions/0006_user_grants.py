"""Per-user grants: the right to upload and run code bundles, given to one member where
HALFWAY_CODE_JOBS is 'admins'. Its own table, so the user row stays as it is.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "user_grant",
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("right_name", sa.String(length=16), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("right_name IN ('code')", name="ck_user_grant_right"),
        sa.ForeignKeyConstraint(["user_id"], ["user.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("user_id", "right_name"),
    )


def downgrade() -> None:
    op.drop_table("user_grant")
