"""Gradient samples and the precision decision.

``gradient_sample``: every ``gradients.every`` steps, the statistics of the scaled gradient
for the whole model (columns) and per variable (a JSON list), and on shadow steps what
float16 flushed at that scale and what the run really lost. A foreign key to the job (unlike
``step``, migration 0002): a sample is a few per hundred steps, written in the general flush,
so the per-row check costs nothing that matters, and a removed job takes its samples along.

On the job: ``precision_decision`` (the auto policy's pick and its probes) and
``gradients_summary`` (the latest sample and the latest shadow sample, model level).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The figures' columns as of this revision: a migration keeps its own copy rather than import
# service.vocabulary.GRADIENT_FIGURES, so that a later change there cannot rewrite what this
# revision created.
FIGURES = (
    "zero_share",
    "log2_max",
    "log2_min_nonzero",
    "headroom",
    "subnormal_share",
    "underflow_share",
    "lost_share",
    "relative_error",
)


def upgrade() -> None:
    op.create_table(
        "gradient_sample",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("loss_scale", sa.Float(), nullable=False),
        sa.Column("shadow", sa.Boolean(), nullable=False),
        sa.Column("finite", sa.Boolean(), nullable=False),
        *(sa.Column(name, sa.Float(), nullable=True) for name in FIGURES),
        sa.Column("variables", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "step"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_gradient_sample_shadow", "gradient_sample", ["job_id", "shadow", "step"])
    # Plain ALTER TABLE, as in 0003: a batch migration would rebuild the job table.
    op.add_column("job", sa.Column("precision_decision", sa.JSON(), nullable=True))
    op.add_column("job", sa.Column("gradients_summary", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("job", "gradients_summary")
    op.drop_column("job", "precision_decision")
    op.drop_index("ix_gradient_sample_shadow", table_name="gradient_sample")
    op.drop_table("gradient_sample")
