"""Users can be disabled, and every change to a user bumps one shared auth generation.

API processes cache verified tokens. A token replaced, a user removed or disabled must stop
working at once in every process on the database, so each process re-reads this one-row
counter at most ``AUTH_RECHECK_SECONDS`` after its last read, drops its cache when it moved,
and the CLI command that changed a user returns only after that window
(service/people/authcache.py).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("user") as batch:
        batch.add_column(
            sa.Column("disabled", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.create_table(
        "auth_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_auth_state_one_row"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute("INSERT INTO auth_state (id, generation) VALUES (1, 0)")


def downgrade() -> None:
    op.drop_table("auth_state")
    with op.batch_alter_table("user") as batch:
        batch.drop_column("disabled")
