"""The ``halfway`` command: run the server and workers, manage the database and users."""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from service.client import commands as client_commands

# The server's side (SQLAlchemy, Alembic, the settings, auth) is imported by the commands
# that use it, not here: `halfway jobs` and the other client commands only talk HTTP, and
# loading the database layer would more than double their start-up time.
if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from service.database.db import Database
    from service.settings import Settings
    from workers.supervisor import Supervisor

app = typer.Typer(
    help="Halfway: mixed-precision Keras training as a service.",
    no_args_is_help=True,
    add_completion=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
users_app = typer.Typer(help="Users and API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(users_app, name="users")

log = logging.getLogger("halfway")
_T = TypeVar("_T")


def _setup_logging(json_logs: bool = False) -> None:
    from service.logs import configure

    configure(json_logs)


def _database(settings: Settings) -> Database:
    from service.database.db import Database

    settings.ensure_dirs()
    return Database.connect(settings.resolved_database_url())


def _open(revision: str = "head") -> tuple[Settings, Database]:
    """The settings from the environment, and the database they name, migrated."""
    from service.database import migrate
    from service.settings import Settings

    settings = Settings()
    db = _database(settings)
    migrate.upgrade(db.engine, revision)
    return settings, db


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    worker: Annotated[
        bool | None,
        typer.Option(
            "--worker/--no-worker",
            help="Run an embedded worker (default: HALFWAY_EMBEDDED_WORKER, true).",
        ),
    ] = None,
    no_auth: Annotated[
        bool,
        typer.Option("--no-auth", help="No tokens at all. Only allowed on a loopback address."),
    ] = False,
    json_logs: Annotated[bool, typer.Option("--json-logs", help="Structured JSON logs.")] = False,
    access_log: Annotated[
        bool, typer.Option("--access-log", help="Log every request (off: dashboards poll a lot).")
    ] = False,
) -> None:
    """Run the API (and, by default, an embedded worker), applying migrations first."""
    import uvicorn

    from service.api.app import create_app
    from service.database import migrate
    from service.people import auth
    from service.priority import lower_this_thread
    from service.settings import Settings
    from workers.supervisor import Supervisor

    _setup_logging(json_logs)
    settings = Settings()
    if host is not None:
        settings.host = host
    if port is not None:
        settings.port = port
    if no_auth and not _is_loopback(settings.host):
        typer.echo(
            f"refusing --no-auth on {settings.host}: without tokens anyone who can reach the "
            "port can submit and cancel jobs. Bind to 127.0.0.1 or use tokens.",
            err=True,
        )
        raise typer.Exit(2)
    db = _database(settings)
    migrate.upgrade(db.engine)
    if worker is None:
        worker = settings.embedded_worker
    # A wildcard bind is not an address anyone can open; print one that is.
    shown = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = f"http://{shown}:{settings.port}"
    if no_auth:
        typer.secho(
            "WARNING: authentication is OFF (--no-auth). Every request acts as admin 'local'. "
            "This is only safe because the server listens on loopback.",
            fg=typer.colors.RED,
            bold=True,
            err=True,
        )
    else:
        with db.write() as session:
            # Under the schema lock: servers starting together create one admin, not two.
            migrate.hold_lock(session.connection())
            first = not auth.any_users(session)
            token = auth.add_user(session, "admin", admin=True) if first else None
        if token is not None:
            typer.echo(
                "\nNo users yet, so Halfway created an admin. Its token is shown only now:\n\n"
                f"    {token}\n\n"
                # '#token=' never reaches the server, so the token stays out of access logs.
                f"Dashboard: {base}/#token={token}\n"
                f"API:       curl -H 'Authorization: Bearer {token}' {base}/v1/jobs\n"
                "More users: halfway users add NAME [--admin]\n"
                "Lost it? On this host: halfway users token admin (a new one replaces it)\n",
                err=True,
            )

    supervisor = _supervisors(lambda: [Supervisor(db, settings)])[0] if worker else None
    thread: threading.Thread | None = None

    def start() -> None:
        nonlocal thread
        if supervisor is not None:
            thread = threading.Thread(
                target=supervisor.run_forever, name="halfway-worker", daemon=True
            )
            thread.start()
        # After the supervisor's thread exists: it, and the training it spawns, keep theirs.
        lower_this_thread(settings.api_nice)

    def stop() -> None:
        if supervisor is not None and thread is not None:
            supervisor.stop()
            # The running job's child gets SIGTERM, checkpoints and goes back to the queue.
            thread.join(timeout=settings.cancel_grace_seconds + 15)

    api = create_app(settings, db, auth=not no_auth, on_startup=start, on_shutdown=stop)
    typer.echo(f"Halfway on {base} (docs: {base}/docs)", err=True)
    uvicorn.run(
        api,
        host=settings.host,
        port=settings.port,
        log_level="info",
        log_config=None,
        access_log=access_log,
    )


@app.command()
def worker(
    gpus: Annotated[
        str | None,
        typer.Option(help="GPU ids (0,1,...) or 'all'; one supervisor per GPU. Default: CPU."),
    ] = None,
    gpus_per_slot: Annotated[
        int, typer.Option(help="GPUs each supervisor holds (for multi-GPU jobs).")
    ] = 1,
    json_logs: Annotated[bool, typer.Option("--json-logs", help="Structured JSON logs.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve this worker's Prometheus metrics (history-write latency)."),
    ] = None,
    launcher: Annotated[
        str,
        typer.Option(help="Where training runs: 'local' (a process here) or 'ray' (a Ray actor)."),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(help="The Ray cluster (default: RAY_ADDRESS, else a Ray of our own)."),
    ] = None,
    max_jobs: Annotated[
        int, typer.Option(min=1, help="With --launcher ray: jobs this worker runs at once.")
    ] = 1,
    ray_cpus_per_job: Annotated[
        float, typer.Option(min=0, help="With --launcher ray: CPUs each job's actor asks for.")
    ] = 1.0,
) -> None:
    """Run worker supervisors (no API) against the configured database."""
    from workers.gpus import parse_gpus, slots
    from workers.supervisor import Supervisor, new_worker_id

    _setup_logging(json_logs)
    settings, db = _open()
    if launcher not in ("local", "ray"):
        typer.echo(f"--launcher: 'local' or 'ray', not {launcher!r}", err=True)
        raise typer.Exit(2)
    if launcher == "ray" and gpus is not None:
        typer.echo("--gpus: with --launcher ray, Ray hands out the GPUs", err=True)
        raise typer.Exit(2)
    try:
        gpu_ids = parse_gpus(gpus)
        groups = slots(gpu_ids, gpus_per_slot)
    except ValueError as exc:
        typer.echo(f"--gpus: {exc}", err=True)
        raise typer.Exit(2) from None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=settings.host)
    if launcher == "ray":
        supervisors = _ray_supervisors(db, settings, ray_address, max_jobs, ray_cpus_per_job)
    else:
        supervisors = _supervisors(
            lambda: [
                Supervisor(db, settings, gpu_ids=group, worker_id=new_worker_id(f"s{i}"))
                for i, group in enumerate(groups)
            ]
        )
    threads = [
        threading.Thread(target=s.run_forever, name=f"halfway-worker-{i}", daemon=True)
        for i, s in enumerate(supervisors)
    ]
    for t in threads:
        t.start()
    stopping = threading.Event()

    import signal

    def _stop(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stopping.wait()
    log.info("stopping: running jobs checkpoint and go back to the queue")
    for s in supervisors:
        s.stop()
    for t in threads:
        t.join(timeout=settings.cancel_grace_seconds + 15)


def _supervisors(make: Callable[[], list[Supervisor]]) -> list[Supervisor]:
    """The supervisors ``make`` builds, or a clear refusal when the sandbox that
    HALFWAY_CODE_ISOLATION=bubblewrap requires cannot be made on this host."""
    from workers.sandbox import IsolationUnavailable

    try:
        return make()
    except IsolationUnavailable as exc:
        typer.echo(f"halfway: {exc}", err=True)
        raise typer.Exit(2) from None


def _ray_supervisors(
    db: Database, settings: Settings, address: str | None, max_jobs: int, cpus: float
) -> list[Supervisor]:
    """``max_jobs`` supervisors sharing one Ray connection: each claims and runs one job at
    a time as now, and Ray places each job's actor on a node with room. A supervisor holds
    as many GPUs as the largest node has, so it claims only jobs Ray could place."""
    from workers.ray_launcher import RayLauncher
    from workers.supervisor import Supervisor, new_worker_id

    try:
        ray = RayLauncher(address, cpus_per_job=cpus)
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        typer.echo("--launcher ray needs Ray: pip install 'halfway[ray]'", err=True)
        raise typer.Exit(2) from None
    held = list(range(ray.gpus_per_node()))
    return [
        Supervisor(db, settings, gpu_ids=held, worker_id=new_worker_id(f"r{i}"), launcher=ray)
        for i in range(max_jobs)
    ]


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations (to the newest revision by default)."""
    _, db = _open(revision)
    typer.echo(f"database at {revision}: {db.engine.url.render_as_string(hide_password=True)}")


@users_app.command("add")
def users_add(
    name: str,
    admin: Annotated[bool, typer.Option("--admin", help="Give the admin role.")] = False,
    code: Annotated[
        bool, typer.Option("--code", help="Grant the right to upload and run code bundles.")
    ] = False,
) -> None:
    """Create a user and print its token (shown once; only a hash is stored)."""
    from service.errors import Conflict
    from service.people import auth, grants

    _, db = _open()
    try:
        with db.write() as session:
            token = auth.add_user(session, name, admin=admin)
            if code:
                grants.grant(session, name, "code")
    except Conflict as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(token)
    typer.echo(f"Shown only now. Lost it? halfway users token {name} (a new one)", err=True)


def _change_user(
    name: str, change: Callable[[Session], _T], done: Callable[[_T], str | None]
) -> _T:
    """Apply a change to a user, then wait until every API process on the database has seen
    it (service/people/authcache.py), so what the command took away is refused once it returns."""
    from service.errors import HalfwayError
    from service.people.authcache import settle

    _, db = _open()
    try:
        with db.write() as session:
            result = change(session)
    except HalfwayError as exc:
        typer.echo(exc.message, err=True)
        raise typer.Exit(1) from None
    finally:
        db.dispose()
    settle()
    message = done(result)
    if message:
        typer.echo(message, err=True)
    return result


@users_app.command("token")
def users_token(name: str) -> None:
    """Replace a user's token with a new one and print it; the old one stops working at once,
    in every API process."""
    from service.people import auth

    token = _change_user(
        name,
        lambda session: auth.rotate_token(session, name),
        lambda _: f"{name}'s old token no longer works.",
    )
    typer.echo(token)
    typer.echo(f"Shown only now. Lost it? halfway users token {name} (a new one)", err=True)


@users_app.command("remove")
def users_remove(name: str) -> None:
    """Delete a user; its token stops working at once. Its jobs stay (owned by the name)."""
    from service.people import auth

    _change_user(
        name,
        lambda session: auth.remove_user(session, name),
        lambda _: f"removed {name}; its token no longer works.",
    )


@users_app.command("disable")
def users_disable(name: str) -> None:
    """Refuse a user's token until `halfway users enable NAME`; its jobs go on."""
    from service.people import auth

    _change_user(
        name,
        lambda session: auth.set_disabled(session, name, True),
        lambda changed: f"{name} {'is now' if changed else 'was already'} disabled.",
    )


@users_app.command("enable")
def users_enable(name: str) -> None:
    """Accept a disabled user's token again."""
    from service.people import auth

    _change_user(
        name,
        lambda session: auth.set_disabled(session, name, False),
        lambda changed: f"{name} {'is now' if changed else 'was already'} enabled.",
    )


class Right(StrEnum):
    code = "code"


def _change_grant(name: str, right: Right, give: bool) -> None:
    from service.errors import Conflict
    from service.people import grants

    _, db = _open()
    try:
        with db.write() as session:
            changed = (grants.grant if give else grants.revoke)(session, name, right.value)
    except Conflict as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    if give:
        typer.echo(f"{name} may run {right.value}" + ("" if changed else " (already could)"))
    else:
        typer.echo(f"{name} no longer holds {right.value}" + ("" if changed else " (never did)"))


@users_app.command("grant")
def users_grant(name: str, right: Right) -> None:
    """Give a user a right (code: upload and run code bundles when HALFWAY_CODE_JOBS=admins)."""
    _change_grant(name, right, give=True)


@users_app.command("revoke")
def users_revoke(name: str, right: Right) -> None:
    """Take a right from a user."""
    _change_grant(name, right, give=False)


@users_app.command("shares")
def users_shares() -> None:
    """Each user's fair-share weight, share, recent use and standing (docs/scheduling.md),
    the next to be served first."""
    from service.scheduling import fairshare

    settings, db = _open()
    rule = fairshare.Rule.from_settings(settings)
    try:
        with db.read() as session:
            shares = fairshare.shares(session, rule)
    finally:
        db.dispose()
    typer.echo(
        f"{'user':<20} {'weight':>8} {'share':>7} {'used (h)':>10} {'of use':>7} "
        f"{'standing':>10} {'running':>7} {'window (h)':>10}"
    )
    for s in shares:
        typer.echo(
            f"{s.owner:<20} {s.weight:>8g} {s.share:>7.1%} {s.usage / 3600:>10.2f} "
            f"{s.usage_share:>7.1%} {s.standing:>10.0f} {s.running:>7} {s.spent / 3600:>10.2f}"
        )
    typer.echo(f"(use decays by half every {settings.fairshare_half_life:g} s)", err=True)
    budget = f"{settings.budget_slot_hours:g} slot-hours" if rule.has_budget else "no budget"
    typer.echo(
        f"(window (h): slot-hours in this {settings.budget_window:g} s window; {budget})",
        err=True,
    )


@users_app.command("share")
def users_share(name: str, weight: Annotated[float, typer.Argument(min=0.000001)]) -> None:
    """Set a user's fair-share weight (1 by default): twice the weight, twice the share."""
    from service.errors import HalfwayError
    from service.scheduling import fairshare

    _, db = _open()
    try:
        with db.write() as session:
            fairshare.set_weight(session, name, weight)
    except HalfwayError as exc:
        typer.echo(exc.message, err=True)
        raise typer.Exit(1) from None
    finally:
        db.dispose()
    typer.echo(f"{name}'s weight is now {weight:g}")


def main() -> None:
    client_commands.register(app)
    app(prog_name="halfway")


if __name__ == "__main__":
    main()
