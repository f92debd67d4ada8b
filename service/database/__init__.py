"""The database underneath everything: ``db`` (engines and sessions for SQLite and
PostgreSQL), ``models`` (the ORM classes, matching ``migrations/``), ``dbclock`` (the
database's clock, which leases are compared on) and ``migrate`` (Alembic, run on start)."""
