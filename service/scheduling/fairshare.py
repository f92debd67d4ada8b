"""Fair share by recent use: the claim order, usage accrual, queue positions and shares.

The rule (docs/scheduling.md has it with its reasons). An owner's *usage* U is slot-seconds,
GPU-seconds for a job holding GPUs (a job's running wall time times ``max(gpus, 1)``), decayed
with the half-life H (``HALFWAY_FAIRSHARE_HALF_LIFE``)::

    U(now) = S * 2 ** (-(now - as_of) / H) + sum over the owner's running jobs of
             (now - accrued_at) * max(gpus, 1)

where ``S`` and ``as_of`` are the owner's ``user_usage`` row, to which a run's time is added
when it ends (``accrue``: ``S <- S * 2 ** (-(now - as_of) / H) + elapsed``, ``as_of <- now``).
A running job therefore counts while it runs, and every host computes the same figure from
the database alone, on the database's clock. Among jobs of equal priority the claim goes to
the owner with the lowest ``U / weight`` (the furthest below their share; weight 1 unless an
admin set one), at equal standing to the owner with fewer running jobs (so that two owners who
both have used nothing alternate, as before), then to the oldest job (``claim_order``).

Why decay inside the statement: scaling every owner's ``S`` by one factor would not change the
order, but each row was last decayed at its own ``as_of``, and the running time is added
undecayed, so ``S * 2 ** (-(now - as_of) / H)`` must be brought to one ``now`` before adding.

Positions (``queue``) use the same ``claim_order`` over the same expressions. Each claim adds
one running job to its owner (and nothing to its usage yet: its time since the claim is 0), so
the k-th queued job of an owner (by priority, then age) is ranked with that owner's running
count plus k; ordering every claimable job by that key gives exactly the sequence repeated
claims at one instant would take, since each owner's own jobs already come in that order.
A position is a snapshot: as running jobs accrue time the order moves.

The budget (optional, ``HALFWAY_BUDGET_SLOT_HOURS``; 0, the default, means none). Time is cut
into fixed windows of ``HALFWAY_BUDGET_WINDOW`` seconds (a week by default) counted from
Monday 1970-01-05 00:00 UTC, so a week's window starts on Monday and a day's at midnight UTC.
An owner's *spent* time is the slot-seconds of their runs within the current window, undecayed:
the ``window_used`` of their ``user_usage`` row if it counts this window, plus each running
job's time since the later of its ``accrued_at`` and the window's start. While spent is at or
over the budget, none of the owner's queued jobs is claimed (reason ``budget``) and none
preempts; a job already running goes on to its end, and a job whose worker vanished is still
reclaimed. A new window starts every owner from nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Subquery,
    and_,
    case,
    func,
    literal,
    or_,
    select,
    union,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from service.database.dbclock import db_now
from service.database.models import Job, User, UserUsage, UTCDateTime
from service.errors import NotFound
from service.scheduling.slots import largest as largest_slot
from service.settings import Settings
from service.vocabulary import QueueReason

DEFAULT_HALF_LIFE = 86400.0
# 2**-1000 is still a normal double, and PostgreSQL's power() raises on underflow: after a
# thousand half-lives the usage is as good as zero.
MAX_HALVINGS = 1000.0
# Budget windows are whole multiples of the window from here: a Monday, 00:00 UTC.
WINDOW_ORIGIN = datetime(1970, 1, 5, tzinfo=UTC)
DEFAULT_WINDOW = 7 * 86400.0

Reason = QueueReason


@dataclass(frozen=True)
class Rule:
    """What the order depends on beyond the database: the half-life, the per-user cap
    (``HALFWAY_MAX_RUNNING_PER_USER``; 0: none) and the budget of slot-seconds per owner per
    window (0: none). Every host should use the same values."""

    half_life: float = DEFAULT_HALF_LIFE
    max_running_per_user: int = 0
    budget_seconds: float = 0.0
    window_seconds: float = DEFAULT_WINDOW
    # A worker's slot counts as live this long after its last claim (service/scheduling/slots.py).
    slot_live_seconds: float = 180.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Rule:
        return cls(
            half_life=settings.fairshare_half_life,
            max_running_per_user=settings.max_running_per_user,
            budget_seconds=settings.budget_slot_hours * 3600.0,
            window_seconds=settings.budget_window,
            # An idle worker claims every poll; one waiting for its GPUs to free up claims
            # nothing for up to gpu_free_timeout_seconds.
            slot_live_seconds=max(settings.lease_seconds, settings.gpu_free_timeout_seconds)
            + 10 * settings.poll_seconds,
        )

    @property
    def has_budget(self) -> bool:
        return self.budget_seconds > 0


class seconds_between(FunctionElement[float]):  # lower case: it reads as the SQL it is
    """``later - earlier`` in seconds, at least 0; 0 when ``earlier`` is NULL."""

    type = Float()
    inherit_cache = True
    name = "halfway_seconds_between"

    def __init__(self, earlier: Any, later: Any) -> None:
        super().__init__(earlier, later)


def _operands(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> tuple[str, str]:
    earlier, later = element.clauses
    return compiler.process(earlier, **kw), compiler.process(later, **kw)


@compiles(seconds_between, "postgresql")
def _postgresql(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    earlier, later = _operands(element, compiler, **kw)
    # GREATEST skips a NULL, so a NULL start counts as 0.
    return f"GREATEST(CAST(EXTRACT(EPOCH FROM ({later}) - ({earlier})) AS DOUBLE PRECISION), 0)"


@compiles(seconds_between, "sqlite")
def _sqlite(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    earlier, later = _operands(element, compiler, **kw)
    return f"MAX(COALESCE((julianday({later}) - julianday({earlier})) * 86400.0, 0), 0)"


class whole(FunctionElement[int]):  # lower case: it reads as the SQL it is
    """The integer part of a number that is at least 0 (SQLite may lack FLOOR)."""

    type = BigInteger()
    inherit_cache = True
    name = "halfway_whole"

    def __init__(self, number: Any) -> None:
        super().__init__(number)


@compiles(whole, "postgresql")
def _whole_postgresql(element: whole, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(FLOOR({compiler.process(element.clauses, **kw)}) AS BIGINT)"


@compiles(whole, "sqlite")
def _whole_sqlite(element: whole, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST({compiler.process(element.clauses, **kw)} AS INTEGER)"


def at_time(at: datetime | None) -> ColumnElement[datetime]:
    """The instant the order is computed for: the database's now, or (tests, benchmarks) a
    fixed one, so that positions and claims can be compared at one instant."""
    return db_now() if at is None else literal(at, UTCDateTime())


def slots(job: Any) -> ColumnElement[int]:
    """What a running job uses per second: its GPUs, or one slot without any."""
    rate: ColumnElement[int] = case((func.coalesce(job.gpus, 0) > 1, job.gpus), else_=1)
    return rate


def lesser(a: Any, b: Any) -> ColumnElement[float]:
    smaller: ColumnElement[float] = case((a < b, a), else_=b)
    return smaller


def window_of(now: Any, seconds: float) -> tuple[ColumnElement[int], ColumnElement[float]]:
    """The budget window ``now`` falls in (whole windows since ``WINDOW_ORIGIN``) and how many
    seconds of it have passed."""
    since_origin = seconds_between(literal(WINDOW_ORIGIN, UTCDateTime()), now)
    length = literal(float(seconds), Float())
    index = whole(since_origin / length)
    into: ColumnElement[float] = since_origin - index * length
    return index, into


def decayed(usage: Any, as_of: Any, now: Any, half_life: float) -> ColumnElement[float]:
    halvings = seconds_between(as_of, now) / literal(float(half_life), Float())
    capped = case((halvings > MAX_HALVINGS, MAX_HALVINGS), else_=halvings)
    factor: ColumnElement[float] = func.power(literal(0.5, Float()), capped, type_=Float())
    result: ColumnElement[float] = factor * usage
    return result


def claimable() -> ColumnElement[bool]:
    """Queued jobs, and running ones whose worker vanished (lease expired) with attempts left."""
    return or_(
        Job.status == "queued",
        and_(
            Job.status == "running",
            Job.lease_expires_at < db_now(),
            Job.attempt < Job.max_attempts,
            Job.cancel_requested.is_(False),
        ),
    )


def standings(
    *, now: Any, half_life: float, owners: Subquery | None = None, window: float | None = None
) -> Subquery:
    """Each owner's figures, one row per owner (columns ``owner``, ``usage``, ``weight``,
    ``running``, ``key``, and with ``window`` (seconds) ``spent``, the slot-seconds used in
    the current budget window): the owners with jobs queued or running, or those of ``owners``
    (a subquery with an ``owner`` column). A derived table the claim joins, rather than
    subqueries per queued job: its cost is one pass over the active jobs, whatever the
    queue's length (benchmarks/claim.py)."""
    live = and_(Job.status == "running", Job.lease_expires_at >= db_now())
    ran = seconds_between(Job.accrued_at, now)
    sums = [
        func.count(case((live, 1))).label("running"),
        func.sum(case((live, ran * slots(Job)), else_=0.0)).label("running_time"),
    ]
    if window is not None:
        index, into = window_of(now, window)
        in_window = lesser(ran, into) * slots(Job)
        sums.append(func.sum(case((live, in_window), else_=0.0)).label("running_in_window"))
    active = (
        select(Job.owner.label("owner"), *sums)
        .where(Job.status.in_(("queued", "running")))
        .group_by(Job.owner)
        .subquery("active")
    )
    base = active if owners is None else owners
    usage = func.coalesce(
        decayed(UserUsage.usage_seconds, UserUsage.as_of, now, half_life), 0.0
    ) + func.coalesce(active.c.running_time, 0.0)
    weight = func.coalesce(UserUsage.weight, 1.0)
    columns = [
        base.c.owner.label("owner"),
        usage.label("usage"),
        weight.label("weight"),
        func.coalesce(active.c.running, 0).label("running"),
        (usage / weight).label("key"),
    ]
    if window is not None:
        ended = case((UserUsage.window_index == index, UserUsage.window_used), else_=0.0)
        spent = func.coalesce(ended, 0.0) + func.coalesce(active.c.running_in_window, 0.0)
        columns.append(spent.label("spent"))
    query = select(*columns)
    if owners is not None:
        query = query.select_from(owners).outerjoin(active, active.c.owner == owners.c.owner)
    return query.outerjoin(UserUsage, UserUsage.owner == base.c.owner).subquery("standing")


def claim_order(
    priority: Any, key: Any, running: Any, created_at: Any, job_id: Any
) -> list[ColumnElement[Any]]:
    """THE order of the queue, for the claim and for positions alike: priority, then the
    owner furthest below their share, then the owner with fewer running jobs, then the
    oldest job."""
    return [priority.desc(), key, running, created_at, job_id]


# ---------------------------------------------------------------------------------------------
# Accrual


def accrue(
    session: Session, *, owner: str, since: datetime | None, gpus: int | None, rule: Rule
) -> None:
    """Add a run's time since ``since`` (its ``accrued_at``) to its owner's usage, decaying
    what was there to the database's now first, and its time within the current budget
    window to the window's count (a count of an earlier window starts afresh). Called in the
    transaction that ends the run."""
    if since is None:
        return
    rate = max(gpus or 0, 1)
    ran = seconds_between(literal(since, UTCDateTime()), db_now())
    index, into = window_of(db_now(), rule.window_seconds)
    stmt = _insert(session).values(
        owner=owner,
        weight=1.0,
        usage_seconds=ran * rate,
        as_of=db_now(),
        window_index=index,
        window_used=lesser(ran, into) * rate,
    )
    same_window = UserUsage.window_index == stmt.excluded.window_index
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["owner"],
            set_={
                "usage_seconds": decayed(
                    UserUsage.usage_seconds, UserUsage.as_of, db_now(), rule.half_life
                )
                + stmt.excluded.usage_seconds,
                "as_of": stmt.excluded.as_of,
                "window_used": case(
                    (same_window, UserUsage.window_used + stmt.excluded.window_used),
                    else_=stmt.excluded.window_used,
                ),
                "window_index": stmt.excluded.window_index,
            },
        )
    )


def set_weight(session: Session, owner: str, weight: float) -> None:
    """An admin's weight for ``owner`` (a user): twice the weight, twice the share."""
    if session.scalar(select(User.id).where(User.name == owner)) is None:
        raise NotFound(f"user {owner} does not exist")
    stmt = _insert(session).values(owner=owner, weight=weight, usage_seconds=0.0, as_of=db_now())
    session.execute(
        stmt.on_conflict_do_update(index_elements=["owner"], set_={"weight": stmt.excluded.weight})
    )
    session.flush()


def _insert(session: Session) -> Any:
    """An INSERT into ``user_usage`` that takes ON CONFLICT, in the session's dialect."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(UserUsage)
    return sqlite.insert(UserUsage)


# ---------------------------------------------------------------------------------------------
# Positions and shares


@dataclass(frozen=True)
class Place:
    job_id: int
    name: str
    owner: str
    status: str
    priority: int
    created_at: datetime
    usage: float  # the owner's usage now, seconds
    weight: float
    position: int | None  # 1: the next claim takes it; None: held back by the per-user cap
    ahead: int  # claimable jobs before it in the order
    reason: Reason


def queue(session: Session, rule: Rule, *, at: datetime | None = None) -> list[Place]:
    """Every claimable job in claim order, with its position and why it waits.

    Reasons: ``next`` (position 1); ``priority`` (a job of higher priority is ahead);
    ``share`` (a job of another owner who stands further below their share, or at equal
    standing runs fewer jobs, is ahead); ``age`` (only older jobs of equal standing are ahead,
    the owner's own included); ``per-user cap`` (the owner would reach the cap before this
    job; no position); ``budget`` (the owner has spent the window's budget; no position until
    the next window); ``no slot`` (the job needs more GPUs than any live worker's slot
    holds, ``service.scheduling.slots``; no position, and nothing said while no slot is live)."""
    window = rule.window_seconds if rule.has_budget else None
    st = standings(now=at_time(at), half_life=rule.half_life, window=window)
    spent = st.c.spent if window is not None else literal(0.0, Float())
    rank = func.row_number().over(
        partition_by=Job.owner, order_by=(Job.priority.desc(), Job.created_at, Job.id)
    )
    inner = (
        select(
            Job.id,
            Job.name,
            Job.owner,
            Job.status,
            Job.priority,
            Job.created_at,
            Job.gpus,
            st.c.usage,
            st.c.weight,
            st.c.running,
            st.c.key,
            spent.label("spent"),
            (rank - 1).label("rank"),
        )
        .join(st, st.c.owner == Job.owner)
        .where(claimable())
        .subquery()
    )
    rows = session.execute(
        select(inner).order_by(
            *claim_order(
                inner.c.priority,
                inner.c.key,
                inner.c.running + inner.c.rank,
                inner.c.created_at,
                inner.c.id,
            )
        )
    ).all()
    cap = rule.max_running_per_user
    most_gpus = largest_slot(session, live_seconds=rule.slot_live_seconds)
    held: dict[int, Reason] = {}  # jobs no claim would take now, and why
    for row in rows:
        if most_gpus is not None and (row.gpus or 0) > most_gpus:
            held[row.id] = "no slot"
        elif rule.has_budget and row.status == "queued" and row.spent >= rule.budget_seconds:
            held[row.id] = "budget"
        elif cap > 0 and row.running + row.rank >= cap:
            held[row.id] = "per-user cap"
    reasons: dict[int, Reason] = {}
    # Only jobs the claims would take count as ahead of another.
    line = [row for row in rows if row.id not in held]
    block = 0  # where the current priority's jobs start in ``line``
    other: int | None = None  # in that block, the first job of an owner not the block's first
    for i, row in enumerate(line):
        if row.priority != line[block].priority:
            block, other = i, None
        first = line[block]
        if other is None and row.owner != first.owner:
            other = i
        rival = first if first.owner != row.owner else (None if other is None else line[other])
        if i == 0:
            reasons[row.id] = "next"
        elif line[0].priority > row.priority:
            reasons[row.id] = "priority"
        elif rival is not None and (rival.key, rival.running + rival.rank) < (
            row.key,
            row.running + row.rank,
        ):
            reasons[row.id] = "share"
        else:
            reasons[row.id] = "age"
    places: list[Place] = []
    position = 0
    for row in rows:
        reason = held.get(row.id) or reasons[row.id]
        if row.id not in held:
            position += 1
        places.append(
            Place(
                job_id=row.id,
                name=row.name,
                owner=row.owner,
                status=row.status,
                priority=row.priority,
                created_at=row.created_at,
                usage=float(row.usage),
                weight=float(row.weight),
                position=None if row.id in held else position,
                ahead=position if row.id in held else position - 1,
                reason=reason,
            )
        )
    return places


@dataclass(frozen=True)
class Share:
    owner: str
    weight: float
    share: float  # weight / all listed weights
    usage: float  # seconds, decayed, running jobs included
    usage_share: float  # usage / all listed usage (0 when nobody used anything)
    standing: float  # usage / weight: the claim's key
    running: int
    spent: float  # slot-seconds in the current budget window, running jobs included


def shares(session: Session, rule: Rule, *, at: datetime | None = None) -> list[Share]:
    """Every user's (and every owner's with recorded use or jobs waiting or running) weight,
    share, recent usage and standing, lowest standing (next to be served) first."""
    names = union(
        select(User.name.label("owner")),
        select(UserUsage.owner.label("owner")),
        select(Job.owner.label("owner")).where(Job.status.in_(("queued", "running"))),
    ).subquery()
    st = standings(
        now=at_time(at), half_life=rule.half_life, owners=names, window=rule.window_seconds
    )
    rows = session.execute(
        select(st.c.owner, st.c.usage, st.c.weight, st.c.running, st.c.spent)
    ).all()
    total_weight = sum(float(r[2]) for r in rows) or 1.0
    total_usage = sum(float(r[1]) for r in rows)
    out = [
        Share(
            owner=r[0],
            weight=float(r[2]),
            share=float(r[2]) / total_weight,
            usage=float(r[1]),
            usage_share=float(r[1]) / total_usage if total_usage > 0 else 0.0,
            standing=float(r[1]) / float(r[2]),
            running=int(r[3]),
            spent=float(r[4]),
        )
        for r in rows
    ]
    return sorted(out, key=lambda s: (s.standing, s.running, s.owner))
