"""Preemption at checkpoints (service/scheduling/preemption.py; docs/scheduling.md).

On the job:

- ``preemptions``: each time a waiting job took this one's slot at a checkpoint, a JSON object
  ``{"at", "by_job", "reason", "step"}`` (the database's time of the stop, the waiting job,
  ``priority`` or ``share``, and the acknowledged checkpoint the job resumes from).
- ``preempt_for`` and ``preempt_reason``: a request to stop at the next checkpoint, for the
  waiting job ``preempt_for``, set by one conditional UPDATE and cleared when the run ends.
  Unique (NULLs apart): at most one running job is ever asked to make room for one waiting
  job, even when two supervisors on two hosts decide at once.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE, as in 0003 and 0009: a batch migration would rebuild the job table.
    op.add_column(
        "job",
        sa.Column("preemptions", sa.JSON(), nullable=False, server_default=sa.text("'[]'")),
    )
    op.add_column("job", sa.Column("preempt_for", sa.Integer(), nullable=True))
    op.add_column("job", sa.Column("preempt_reason", sa.String(length=16), nullable=True))
    op.create_index("uq_job_preempt_for", "job", ["preempt_for"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_job_preempt_for", table_name="job")
    op.drop_column("job", "preempt_reason")
    op.drop_column("job", "preempt_for")
    op.drop_column("job", "preemptions")
