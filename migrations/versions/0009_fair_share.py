"""Fair share by recent use (service/scheduling/fairshare.py).

``user_usage``: per owner, the weight an admin gives (default 1) and the recent use in
slot-seconds (GPU-seconds for jobs holding GPUs) as of ``as_of``, decayed with
``HALFWAY_FAIRSHARE_HALF_LIFE`` at each accrual. One row per owner name, so every host's
claim reads the same figures.

On the job: ``accrued_at``, from when a running job's time is not yet in its owner's row (the
claim sets it; the end of the run accrues it). A job running across the upgrade has none and
counts from its next claim.

The claim's scan needs no new index: the owner's figures are one primary-key probe and the
running jobs' sum uses ``ix_job_owner_status`` (benchmarks/claim.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "user_usage",
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("weight", sa.Float(), server_default="1", nullable=False),
        sa.Column("usage_seconds", sa.Float(), server_default="0", nullable=False),
        sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("weight > 0", name="ck_user_usage_weight"),
        sa.PrimaryKeyConstraint("owner"),
    )
    # Plain ALTER TABLE, as in 0003: a batch migration would rebuild the job table.
    op.add_column("job", sa.Column("accrued_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("job", "accrued_at")
    op.drop_table("user_usage")
