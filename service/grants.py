"""Who may run code. A code job runs the user's Python on the GPU server, so it is a right:
``HALFWAY_CODE_JOBS`` says whose by default (``admins``, every ``members``, or nobody:
``off``), and an admin can grant it to one member (``halfway users grant NAME code``).

This is trust between teammates, not a sandbox: whoever holds the right can run anything
the worker's user can."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.auth import Principal
from service.errors import Conflict, Forbidden
from service.models import User, UserGrant, utcnow

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
        raise Forbidden("code jobs are switched off on this server (HALFWAY_CODE_JOBS=off)")
    raise Forbidden(
        f"{principal.name} may not upload or run code: HALFWAY_CODE_JOBS=admins allows admins "
        f"and members an admin granted it (halfway users grant {principal.name} code)"
    )
