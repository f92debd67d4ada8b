"""Users and API tokens. Only a SHA-256 of each token is stored: tokens are 256 random bits,
so a fast hash is enough (there is nothing to brute-force), and the lookup by hash means the
database never sees the token itself.

The lookup by hash is also the whole timing defence: the query compares digests, never the
token, so how long a refusal takes tells a guesser nothing about the token it would need. (A
constant-time compare of the row's digest with the digest it was found by compared a value
with itself, and was dropped.)

Every change to a user row (a new token, removed, disabled, a role) bumps the one-row
``auth_state.generation`` in the same transaction; API processes drop their token caches when
it moves (service/people/authcache.py)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from service.database.models import AuthState, User, utcnow
from service.errors import Conflict, Forbidden, NotFound

TOKEN_PREFIX = "hw_"


@dataclass(frozen=True)
class Principal:
    """Who is making a request."""

    name: str
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


LOCAL_PRINCIPAL = Principal(name="local", role="admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def add_user(session: Session, name: str, *, admin: bool = False) -> str:
    """Create a user and return its token (shown once; only the hash is kept)."""
    if session.scalar(select(User.id).where(User.name == name)) is not None:
        raise Conflict(f"user {name!r} already exists")
    token = new_token()
    session.add(
        User(
            name=name,
            role="admin" if admin else "member",
            token_hash=hash_token(token),
            created_at=utcnow(),
        )
    )
    session.flush()
    return token


def _user(session: Session, name: str) -> User:
    user = session.scalars(select(User).where(User.name == name)).one_or_none()
    if user is None:
        raise NotFound(f"no user {name!r}")
    return user


def rotate_token(session: Session, name: str) -> str:
    user = _user(session, name)
    token = new_token()
    user.token_hash = hash_token(token)
    session.flush()
    return token


def remove_user(session: Session, name: str) -> None:
    """Delete the user; its jobs stay, still owned by the name (owners are names)."""
    session.delete(_user(session, name))
    session.flush()


def set_disabled(session: Session, name: str, disabled: bool) -> bool:
    """Disable or enable a user; returns whether anything changed."""
    user = _user(session, name)
    if user.disabled == disabled:
        return False
    user.disabled = disabled
    session.flush()
    return True


Verdict = Principal | str
"""What a token is: its user, or why it is refused."""

INVALID = "invalid token"


def lookup(session: Session, digest: str) -> tuple[int, Verdict]:
    """The auth generation and what the token with this digest is, read by one statement, so
    both come from the same snapshot of the database."""
    row = session.execute(
        select(AuthState.generation, User.name, User.role, User.disabled)
        .select_from(AuthState)
        .outerjoin(User, User.token_hash == digest)
        .where(AuthState.id == 1)
    ).one()
    generation, name, role, disabled = row
    if name is None:
        return generation, INVALID
    if disabled:
        return generation, f"user {name!r} is disabled; an admin can enable it"
    return generation, Principal(name=name, role=role)


def generation(session: Session) -> int:
    value: int = session.execute(select(AuthState.generation).where(AuthState.id == 1)).scalar_one()
    return value


def authenticate(session: Session, token: str) -> Principal | None:
    verdict = lookup(session, hash_token(token))[1]
    return verdict if isinstance(verdict, Principal) else None


@event.listens_for(Session, "before_flush")
def _bump_generation_on_user_change(session: Session, *_: Any) -> None:
    """Any user row added, changed or deleted in this flush moves the generation, in the same
    transaction: no code path that changes a user (here or in a later command) can forget to."""
    if any(isinstance(o, User) for o in (*session.new, *session.dirty, *session.deleted)):
        session.execute(
            update(AuthState).where(AuthState.id == 1).values(generation=AuthState.generation + 1)
        )


def any_users(session: Session) -> bool:
    return session.scalar(select(User.id).limit(1)) is not None


def require_owner_or_admin(principal: Principal, owner: str, action: str) -> None:
    if principal.name != owner and not principal.is_admin:
        raise Forbidden(f"only {owner} or an admin may {action} this job")
