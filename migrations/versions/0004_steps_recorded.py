"""A job counts the training steps, overflow steps and scale backoffs it has recorded, so
``halfway_steps_recorded_total``, ``halfway_overflow_steps_total`` and
``halfway_loss_scale_backoffs_total`` are true counters.

They used to be sums of the job summary (last step + 1, overflow_count, backoff_count), which
falls when a resumed job's history is cut back to its checkpoint; Prometheus reads a fall as
a counter reset and its rate() goes wrong. The new columns only grow: a step a resumed
attempt trains again is counted again (it was trained again). Existing jobs start from what
they hold.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("steps_recorded", "overflows_recorded", "backoffs_recorded")


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    op.execute(
        "UPDATE job SET steps_recorded = COALESCE(last_step + 1, 0), "
        "overflows_recorded = overflow_count, backoffs_recorded = backoff_count"
    )


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        for name in COLUMNS:
            batch.drop_column(name)
