"""ORM models (SQLAlchemy 2.0). The schema itself comes from Alembic (``migrations/``); these
classes must match it, which ``tests/test_migrations.py`` checks on both databases."""

from __future__ import annotations

import math
import struct
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from service.vocabulary import FINISHED_STATUSES, JOB_STATUSES, SCALE_EVENT_REASONS

__all__ = ["FINISHED_STATUSES", "JOB_STATUSES"]  # re-exported: the ORM's callers use them here

ROLES = ("admin", "member")


def _sql_list(words: tuple[str, ...]) -> str:
    return ", ".join(f"'{w}'" for w in words)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both databases (SQLite keeps no zone, so we add it back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        # SQLite compares datetimes as text; keep every stored value in one naive UTC form.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# The largest finite float32: a stored loss beyond it (or NULL, which is NaN) is non-finite.
FLOAT32_MAX = 3.4028234663852886e38


def float32(value: float) -> float:
    """The nearest float32, as a Python float. PostgreSQL sends a REAL as its shortest decimal
    text ("4.0597076"), which is not the float32 value as a double; rounding restores it."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


class Real32(TypeDecorator[float]):
    """A float32 column (REAL: 4 bytes on PostgreSQL) that reads back the exact float32."""

    impl = REAL
    cache_ok = True

    def process_result_value(self, value: float | None, dialect: Dialect) -> float | None:
        if value is None or dialect.name == "sqlite":
            return value  # SQLite keeps the double it was given, already a float32 value
        return float32(value) if math.isfinite(value) else float(value)


class NanAsNullReal(TypeDecorator[float]):
    """A float32 column where NULL means NaN.

    SQLite cannot store NaN (it silently becomes NULL), so we make that the rule on both
    databases: NaN is stored as NULL and read back as NaN, while +/-inf are stored as
    themselves. Aggregates then skip NaN for free. The values are float32 in TensorFlow,
    so REAL (4 bytes on PostgreSQL) holds them exactly.
    """

    impl = REAL
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> float | None:
        if value is None or math.isnan(value):
            return None
        return float(value)

    def process_result_value(self, value: float | None, dialect: Dialect) -> float:
        if value is None:
            return math.nan
        if dialect.name == "sqlite" or not math.isfinite(value):
            return float(value)
        return float32(value)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
        list[str]: JSON(),
    }


def utcnow() -> datetime:
    return datetime.now(UTC)


class Job(Base):
    __tablename__ = "job"
    __table_args__ = (
        CheckConstraint(
            f"status IN ({_sql_list(JOB_STATUSES)})",
            name="ck_job_status",
        ),
        # The claim query's candidate scan: queued jobs in priority order.
        Index("ix_job_claim", "status", "priority", "created_at"),
        Index("ix_job_owner_id", "owner", "id"),
        # Fair scheduling counts each owner's running jobs.
        Index("ix_job_owner_status", "owner", "status"),
        Index("ix_job_status_id", "status", "id"),
        # One running job asked to make room per waiting job (migration 0011).
        Index("uq_job_preempt_for", "preempt_for", unique=True),
        UniqueConstraint("owner", "idempotency_key", name="uq_job_idempotency"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    spec: Mapped[dict[str, Any]]
    warnings: Mapped[list[str]] = mapped_column(default=list)
    notes: Mapped[list[str]] = mapped_column(default=list)
    priority: Mapped[int] = mapped_column(Integer, default=50)
    gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)  # NULL: one if any, else CPU
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempt_errors: Mapped[list[Any]] = mapped_column(default=list)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    body_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sweep_id: Mapped[int | None] = mapped_column(
        ForeignKey("sweep.id", ondelete="SET NULL"), nullable=True, index=True
    )

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    # The summary a dashboard needs without touching history.
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    steps_per_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_loss: Mapped[float | None] = mapped_column(NanAsNullReal, nullable=True)
    loss_scale: Mapped[float | None] = mapped_column(Float, nullable=True)
    min_loss_scale: Mapped[float | None] = mapped_column(Float, nullable=True)
    overflow_count: Mapped[int] = mapped_column(Integer, default=0)
    growth_count: Mapped[int] = mapped_column(Integer, default=0)
    backoff_count: Mapped[int] = mapped_column(Integer, default=0)
    nonfinite_loss_count: Mapped[int] = mapped_column(Integer, default=0)
    # Only grow (a step a resumed attempt trains again counts again): /metrics' counters.
    steps_recorded: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    overflows_recorded: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    backoffs_recorded: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    steps_per_second: Mapped[float | None] = mapped_column(Float, nullable=True)
    guard_warning: Mapped[str | None] = mapped_column(Text, nullable=True)
    checkpoint_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Each resume that replaces recorded steps moves the version on; the reset step is the
    # first step the latest rewrite replaced (migration 0003).
    history_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    history_reset_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    precision_report: Mapped[list[Any]] = mapped_column(default=list)
    forensics: Mapped[list[Any]] = mapped_column(default=list)
    device: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # The auto policy's pick and its probes (workers.autoprecision), given to every later
    # attempt so that a resumed one builds the same model (migration 0008).
    precision_decision: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # {"latest": ..., "latest_shadow": ...}: the model-level figures of the last gradient
    # sample and of the last shadow sample, kept as samples are written and recomputed when a
    # resume cuts them (service/recording/gradients.py).
    gradients_summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # A running job's time from here on is not yet in its owner's ``user_usage``: set by the
    # claim, read by the fair-share order (a running job counts while it runs) and by the
    # accrual when the run ends (service/scheduling/fairshare.py; migration 0009).
    accrued_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # Each preemption at a checkpoint ({"at", "by_job", "reason", "step"}), and a pending
    # request to stop for the waiting job ``preempt_for`` (service/scheduling/preemption.py; 0011).
    preemptions: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'"))
    preempt_for: Mapped[int | None] = mapped_column(Integer, nullable=True)
    preempt_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)


class Step(Base):
    """One training step. Millions of rows per long job: kept narrow (float32 values) and
    clustered on its primary key; every query on it is a range of ``(job_id, step)``."""

    __tablename__ = "step"
    __table_args__ = ({"sqlite_with_rowid": False},)

    # No foreign key to job: PostgreSQL's per-row trigger check cost several times the COPY
    # itself (migration 0002; docs/results.md has the figures). Only the fenced write path,
    # holding the job row, inserts steps.
    job_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(NanAsNullReal, nullable=True)
    loss_scale: Mapped[float] = mapped_column(Real32)
    finite: Mapped[bool] = mapped_column(Boolean)


class StepRollup(Base):
    """Precomputed summaries of fixed blocks of steps (64, 4096 and 262144 steps at levels 0,
    1 and 2), kept current as history is written. A zoomed-out bucket query over a million
    steps reads a few thousand of these instead of every step."""

    __tablename__ = "step_rollup"
    __table_args__ = ({"sqlite_with_rowid": False},)

    job_id: Mapped[int] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    block: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(Integer)
    # Over finite losses only; NULL when the block has none.
    loss_min: Mapped[float | None] = mapped_column(Real32, nullable=True)
    loss_max: Mapped[float | None] = mapped_column(Real32, nullable=True)
    loss_last: Mapped[float] = mapped_column(NanAsNullReal, nullable=True)
    scale_min: Mapped[float] = mapped_column(Real32)
    scale_max: Mapped[float] = mapped_column(Real32)
    scale_last: Mapped[float] = mapped_column(Real32)
    overflow_count: Mapped[int] = mapped_column(Integer)
    nonfinite_loss_count: Mapped[int] = mapped_column(Integer)


class ScaleEvent(Base):
    """Each change of the loss scale, derived from the step rows as they are written, so the
    events query never scans a million-row history."""

    __tablename__ = "scale_event"
    __table_args__ = (
        CheckConstraint(
            f"reason IN ({_sql_list(SCALE_EVENT_REASONS)})", name="ck_scale_event_reason"
        ),
        {"sqlite_with_rowid": False},
    )

    job_id: Mapped[int] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    old_scale: Mapped[float] = mapped_column(Real32)
    new_scale: Mapped[float] = mapped_column(Real32)
    reason: Mapped[str] = mapped_column(String(8))


class GradientSample(Base):
    """The gradient statistics of one sampled step (every ``gradients.every`` steps): the
    model-level figures as columns, each variable's in ``variables`` (a JSON list). A few
    per hundred steps, written in the supervisor's general flush; a resume deletes those
    from its cut on, as it does the steps (``history.truncate_after``)."""

    __tablename__ = "gradient_sample"
    __table_args__ = (
        # The summary's latest shadow sample after a cut: one probe, however long the job.
        Index("ix_gradient_sample_shadow", "job_id", "shadow", "step"),
        {"sqlite_with_rowid": False},
    )

    job_id: Mapped[int] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    loss_scale: Mapped[float] = mapped_column(Float)
    shadow: Mapped[bool] = mapped_column(Boolean)
    finite: Mapped[bool] = mapped_column(Boolean)
    # NULL where a figure is undefined (no nonzero element; no shadow at this step).
    zero_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    log2_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    log2_min_nonzero: Mapped[float | None] = mapped_column(Float, nullable=True)
    headroom: Mapped[float | None] = mapped_column(Float, nullable=True)
    subnormal_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    underflow_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    lost_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    relative_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    variables: Mapped[list[Any]]


class EpochMetric(Base):
    """The metrics Keras reported at the end of one epoch (``metrics``: name to value; a
    NaN is stored as null). Written in the supervisor's general flush; a resume deletes the
    rows from the epoch it restarts on (migration 0010)."""

    __tablename__ = "epoch_metric"
    __table_args__ = ({"sqlite_with_rowid": False},)

    job_id: Mapped[int] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    metrics: Mapped[dict[str, Any]]


class User(Base):
    __tablename__ = "user"
    __table_args__ = (CheckConstraint("role IN ('admin', 'member')", name="ck_user_role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16), default="member")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    disabled: Mapped[bool] = mapped_column(default=False, server_default=false())


class UserUsage(Base):
    """Fair share (service/scheduling/fairshare.py): an owner's weight and recent use.
    ``usage_seconds`` is slot-seconds (GPU-seconds for jobs holding GPUs) as of ``as_of``, decayed
    with the half-life before each accrual; keyed by the jobs' owner name, so the order every host's
    claim computes comes from the database alone. No row: weight 1, no usage."""

    __tablename__ = "user_usage"
    __table_args__ = (CheckConstraint("weight > 0", name="ck_user_usage_weight"),)

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    usage_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    as_of: Mapped[datetime]
    # The budget (``HALFWAY_BUDGET_SLOT_HOURS``): slot-seconds of runs ended in budget window
    # ``window_index`` (whole windows since fairshare.WINDOW_ORIGIN), undecayed.
    window_index: Mapped[int | None] = mapped_column(BigInteger)
    window_used: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")


class WorkerSlot(Base):
    """A training slot a worker (supervisor) offers: how many GPUs it holds, and when it last
    said so, on the database's clock (service/scheduling/slots.py). Lets the queue say that no slot
    can take a job needing more GPUs than any holds. Removed when the worker stops cleanly."""

    __tablename__ = "worker_slot"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    seen_at: Mapped[datetime]


class AuthState(Base):
    """One row: a counter that every change to a user bumps (service/people/authcache.py)."""

    __tablename__ = "auth_state"
    __table_args__ = (CheckConstraint("id = 1", name="ck_auth_state_one_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    generation: Mapped[int] = mapped_column(BigInteger)


class Sweep(Base):
    __tablename__ = "sweep"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    base_spec: Mapped[dict[str, Any]]
    variants: Mapped[list[Any]]
    target_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class UserGrant(Base):
    """A right given to one user beyond their role (``code``: upload and run code bundles
    where HALFWAY_CODE_JOBS is ``admins``). A table of its own, so rights do not widen the
    user row; a removed user's grants go with it."""

    __tablename__ = "user_grant"
    __table_args__ = (CheckConstraint("right_name IN ('code')", name="ck_user_grant_right"),)

    user_id: Mapped[int] = mapped_column(
        ForeignKey("user.id", ondelete="CASCADE"), primary_key=True
    )
    right_name: Mapped[str] = mapped_column(String(16), primary_key=True)
    granted_at: Mapped[datetime] = mapped_column(default=utcnow)
