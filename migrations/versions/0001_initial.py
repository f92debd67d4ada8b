"""Initial schema: jobs, their per-step history and loss-scale events, users, sweeps.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sweep",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base_spec", sa.JSON(), nullable=False),
        sa.Column("variants", sa.JSON(), nullable=False),
        sa.Column("target_loss", sa.Float(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "user",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("role IN ('admin', 'member')", name="ck_user_role"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_table(
        "job",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("warnings", sa.JSON(), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempt_errors", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("body_hash", sa.String(length=64), nullable=True),
        sa.Column("sweep_id", sa.Integer(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("steps_per_epoch", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("last_loss", sa.REAL(), nullable=True),
        sa.Column("loss_scale", sa.Float(), nullable=True),
        sa.Column("min_loss_scale", sa.Float(), nullable=True),
        sa.Column("overflow_count", sa.Integer(), nullable=False),
        sa.Column("growth_count", sa.Integer(), nullable=False),
        sa.Column("backoff_count", sa.Integer(), nullable=False),
        sa.Column("nonfinite_loss_count", sa.Integer(), nullable=False),
        sa.Column("steps_per_second", sa.Float(), nullable=True),
        sa.Column("guard_warning", sa.Text(), nullable=True),
        sa.Column("checkpoint_step", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("precision_report", sa.JSON(), nullable=False),
        sa.Column("forensics", sa.JSON(), nullable=False),
        sa.Column("device", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name="ck_job_status",
        ),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweep.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_job_idempotency"),
    )
    op.create_index("ix_job_claim", "job", ["status", "priority", "created_at"])
    op.create_index("ix_job_owner_id", "job", ["owner", "id"])
    op.create_index("ix_job_owner_status", "job", ["owner", "status"])
    op.create_index("ix_job_status_id", "job", ["status", "id"])
    op.create_index("ix_job_sweep_id", "job", ["sweep_id"])

    # History tables are clustered on (job_id, step): WITHOUT ROWID on SQLite, and on
    # PostgreSQL the primary key index serves every range query.
    op.create_table(
        "step",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("loss", sa.REAL(), nullable=True),  # NULL means NaN
        sa.Column("loss_scale", sa.REAL(), nullable=False),
        sa.Column("finite", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "step"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "step_rollup",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("level", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("block", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("first_step", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("loss_min", sa.REAL(), nullable=True),
        sa.Column("loss_max", sa.REAL(), nullable=True),
        sa.Column("loss_last", sa.REAL(), nullable=True),  # NULL means NaN
        sa.Column("scale_min", sa.REAL(), nullable=False),
        sa.Column("scale_max", sa.REAL(), nullable=False),
        sa.Column("scale_last", sa.REAL(), nullable=False),
        sa.Column("overflow_count", sa.Integer(), nullable=False),
        sa.Column("nonfinite_loss_count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "level", "block"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "scale_event",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("old_scale", sa.REAL(), nullable=False),
        sa.Column("new_scale", sa.REAL(), nullable=False),
        sa.Column("reason", sa.String(length=8), nullable=False),
        sa.CheckConstraint("reason IN ('overflow', 'growth')", name="ck_scale_event_reason"),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "step"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("scale_event")
    op.drop_table("step_rollup")
    op.drop_table("step")
    op.drop_table("job")
    op.drop_table("user")
    op.drop_table("sweep")
