"""Alembic migrations: the only source of Halfway's schema."""
