"""Who may run code. A code job runs the user's Python on the GPU server, so it is a right:
``HALFWAY_CODE_JOBS`` says whose by default (``admins``, every ``members``, or nobody:
``off``), and an admin can grant it to one member (``halfway users grant NAME code``).

What the code can then reach is the sandbox's to limit (``workers/sandbox.py``): with
isolation on, its own inputs and scratch folder and the slot's GPUs, nothing of the server's.
So the right means "may spend the team's hardware on their own code".

The right is checked on each request that uploads or submits code, and again when a worker
claims a code job (``code_refusal``): a right taken away while the job waited in the queue
stops it before any of its code runs."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.database.models import User, UserGrant, utcnow
from service.errors import Conflict, Forbidden
from service.people.auth import LOCAL_PRINCIPAL, Principal

Right = Literal["code"]
RIGHTS: tuple[Right, ...] = ("code",)


def _user_id(session: Session, name: str) -> int:
    user_id = session.scalar(select(User.id).where(User.name == name))
    if user_id is None:
        raise Conflict(f"no user {name!r}")
    return user_id


def grant(session: Session, name: str, right: Right) -> bool:
    """Give ``name`` the right; False if they had it already."""
    user_id = _user_id(session, name)
    if has_grant(session, name, right):
        return False
    session.add(UserGrant(user_id=user_id, right_name=right, granted_at=utcnow()))
    session.flush()
    return True


def revoke(session: Session, name: str, right: Right) -> bool:
    """Take the right from ``name``; False if they did not have it."""
    user_id = _user_id(session, name)
    result = session.execute(
        delete(UserGrant).where(UserGrant.user_id == user_id, UserGrant.right_name == right)
    )
    session.flush()
    return bool(getattr(result, "rowcount", 0))


def has_grant(session: Session, name: str, right: Right) -> bool:
    row = session.scalar(
        select(UserGrant.user_id)
        .join(User, User.id == UserGrant.user_id)
        .where(User.name == name, UserGrant.right_name == right)
    )
    return row is not None


def may_run_code(
    session: Session, principal: Principal, policy: Literal["admins", "members", "off"]
) -> bool:
    if policy == "off":
        return False
    if policy == "members" or principal.is_admin:
        return True
    return has_grant(session, principal.name, "code")


def require_code_right(
    session: Session, principal: Principal, policy: Literal["admins", "members", "off"]
) -> None:
    if may_run_code(session, principal, policy):
        return
    if policy == "off":
        raise Forbidden(_SWITCHED_OFF)
    raise Forbidden(f"{principal.name} may not upload or run code: {_admins_only(principal.name)}")


def code_refusal(
    session: Session, owner: str, policy: Literal["admins", "members", "off"]
) -> str | None:
    """Why the owner of a code job (the job row's ``owner``) may not run code now, or None if
    they may: the right as it stands when a worker claims the job, not as it stood when the
    job was submitted. A disabled or removed user may run nothing. A job submitted with
    authentication off belongs to ``local`` (an admin, with no user row), and runs as long
    as the policy lets admins run code."""
    row = session.execute(select(User.role, User.disabled).where(User.name == owner)).one_or_none()
    if row is None:
        if owner != LOCAL_PRINCIPAL.name:
            return f"{owner} is no longer a user, so holds no right to run code"
        principal = LOCAL_PRINCIPAL
    else:
        role, disabled = row
        if disabled:
            return f"{owner} is disabled, so may not run code"
        principal = Principal(name=owner, role=role)
    if may_run_code(session, principal, policy):
        return None
    if policy == "off":
        return _SWITCHED_OFF
    return f"{owner} does not hold the code right any more: {_admins_only(owner)}"


_SWITCHED_OFF = "code jobs are switched off on this server (HALFWAY_CODE_JOBS=off)"


def _admins_only(name: str) -> str:
    return (
        "HALFWAY_CODE_JOBS=admins allows admins and members an admin granted it "
        f"(halfway users grant {name} code)"
    )
