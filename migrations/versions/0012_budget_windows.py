"""Budgets of slot-hours per user per window (service/scheduling/fairshare.py; docs/scheduling.md).

On ``user_usage``:

- ``window_index``: which budget window ``window_used`` counts, as a whole number of windows
  since Monday 1970-01-05 00:00 UTC (NULL: nothing recorded yet);
- ``window_used``: the slot-seconds (GPU-seconds) of the owner's runs that ended within that
  window, counted from the window's start. A run that ends in a later window starts the
  count afresh.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE, as in 0009 and 0011: nullable or defaulted columns, no table rebuild.
    op.add_column("user_usage", sa.Column("window_index", sa.BigInteger(), nullable=True))
    op.add_column(
        "user_usage",
        sa.Column("window_used", sa.Float(), nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    op.drop_column("user_usage", "window_used")
    op.drop_column("user_usage", "window_index")
