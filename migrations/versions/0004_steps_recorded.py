"""A job counts the training steps it has recorded, so ``halfway_steps_recorded_total`` is a
true counter.

The metric used to be the sum of each job's last step + 1, which falls when a resumed job's
history is cut back to its checkpoint; Prometheus reads a fall as a counter reset and its
rate() goes wrong. ``steps_recorded`` only grows: a step a resumed attempt trains again is
counted again (it was trained again). Existing jobs start from the steps they hold.

Revision ID: 0004
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.add_column(
            sa.Column("steps_recorded", sa.Integer(), nullable=False, server_default="0")
        )
    op.execute("UPDATE job SET steps_recorded = COALESCE(last_step + 1, 0)")


def downgrade() -> None:
    with op.batch_alter_table("job") as batch:
        batch.drop_column("steps_recorded")
