"""Per-epoch metrics.

``epoch_metric``: one row per job and epoch with the metrics Keras reported at the end of
that epoch (loss, accuracy, validation loss and the rest) as a JSON object. The job keeps
only the last epoch's (``job.metrics["last_epoch"]``); the dashboard's metric charts and
``GET /v1/jobs/{id}/metrics`` read every epoch from here. A few rows per job, written in the
supervisor's general flush; a resume deletes those from the epoch it restarts on (the same
cut as the steps). A foreign key to the job: a removed job takes its rows along.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "epoch_metric",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "epoch"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("epoch_metric")
