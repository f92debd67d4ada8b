"""Users and API tokens. Only a SHA-256 of each token is stored: tokens are 256 random bits,
so a fast hash is enough (there is nothing to brute-force), and the lookup by hash means the
database never sees the token itself."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import Conflict, Forbidden
from service.models import User, utcnow

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


def rotate_token(session: Session, name: str) -> str:
    user = session.scalars(select(User).where(User.name == name)).one_or_none()
    if user is None:
        raise Conflict(f"no user {name!r}")
    token = new_token()
    user.token_hash = hash_token(token)
    session.flush()
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    digest = hash_token(token)
    user = session.scalars(select(User).where(User.token_hash == digest)).one_or_none()
    # The lookup is by hash already; compare again in constant time so no code path ever
    # compares secret material byte by byte.
    if user is None or not hmac.compare_digest(user.token_hash, digest):
        return None
    return Principal(name=user.name, role=user.role)


def any_users(session: Session) -> bool:
    return session.scalar(select(User.id).limit(1)) is not None


def require_owner_or_admin(principal: Principal, owner: str, action: str) -> None:
    if principal.name != owner and not principal.is_admin:
        raise Forbidden(f"only {owner} or an admin may {action} this job")
