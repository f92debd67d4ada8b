"""The training slots workers offer (service/scheduling/slots.py; docs/scheduling.md).

``worker_slot``: one row per running supervisor, its GPUs and when it last said so (the
database's clock). The queue reads the largest live slot to say that a job needing more GPUs
than any slot holds waits for no slot (reason ``no slot``), rather than giving it a place.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_slot",
        sa.Column("worker_id", sa.String(length=128), primary_key=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("worker_slot")
