"""A teammate's code cannot hurt anyone else. A member holding only the code right submits a
hostile bundle that tries, from inside its training child, every attack a shared server
fears: read the server's secrets from its environment and from every process it can see,
open the database (the SQLite file, PostgreSQL on loopback and its socket) and make its
owner an admin, append to another user's artifact, rewrite another user's cached bundle, and
leave a daemon running after its job. The test then proves from outside that none of it
worked, while the job itself trained and stored its own outputs."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.database.db import Database
from service.database.models import User
from service.files import code
from service.people import grants
from service.settings import Settings
from tests.live import Live
from tests.test_code_jobs import bundle_dir, job_log, push, run_until_done
from workers import sandbox

pytestmark = pytest.mark.keras

HOSTILE = {
    "hostile/__init__.py": "",
    "hostile/attack.py": """
import glob, json, os, socket, subprocess, sys


def attempt(name, action):
    try:
        result = action()
        print(f"attack {name}: WORKED {result!r}", flush=True)
    except BaseException as exc:  # each attack is tried; none may stop the others
        print(f"attack {name}: blocked ({type(exc).__name__}: {exc})", flush=True)


def read_environments():
    seen = {"self": dict(os.environ)}
    for path in glob.glob("/proc/*/environ"):
        try:
            with open(path, "rb") as f:
                seen[path] = f.read().decode(errors="replace")
        except OSError as exc:
            seen[path] = str(exc)
    return seen


def sqlite_admin(path):
    import sqlite3
    db = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
    db.execute("UPDATE user SET role = 'admin' WHERE name = 'alice'")
    db.commit()
    return "alice is admin"


def postgres_admin(url):
    import psycopg
    with psycopg.connect(url, connect_timeout=3) as conn:
        conn.execute("UPDATE \\"user\\" SET role = 'admin' WHERE name = 'alice'")
    return "alice is admin"


def socket_to(address):
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(3)
        s.connect(address)
    return "connected"


def append(path):
    with open(path, "ab") as f:
        f.write(b"defaced")
    return "appended"


def rewrite_cached(path):
    os.chmod(os.path.dirname(path), 0o755)
    os.chmod(path, 0o644)
    with open(path, "w") as f:
        f.write("def build(args):\\n    raise SystemExit('poisoned')\\n")
    return "rewritten"


def daemon(token):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", token],
        start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return child.pid


def build(args):
    attempt("environment", lambda: json.dumps(read_environments()))
    if args.get("sqlite"):
        attempt("sqlite", lambda: sqlite_admin(args["sqlite"]))
    if args.get("postgres"):
        attempt("postgres", lambda: postgres_admin(args["postgres"]))
    attempt("postgres-tcp", lambda: socket_to(("127.0.0.1", 5432)))
    attempt("postgres-socket", lambda: socket_to("/var/run/postgresql/.s.PGSQL.5432"))
    attempt("artifact", lambda: append(args["artifact"]))
    attempt("cached-bundle", lambda: rewrite_cached(args["cached"]))
    attempt("daemon", lambda: daemon(args["token"]))

    import keras
    import numpy as np
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    return {"model": model, "train": (x, y)}
""",
}

BENIGN = {
    "benign/__init__.py": "",
    "benign/model.py": "def build(args):\n    raise NotImplementedError\n",
}


def processes_with(token: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_hostile_bundle_reaches_no_secret_no_database_no_other_file_and_leaves_no_process(
    live: Live,
    db: Database,
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert sandbox.resolve(settings.code_isolation).mode == "bubblewrap", sandbox.probe()
    # Secrets the server holds, in the environment of this process (the API and the
    # supervisor run here, as under `halfway serve`).
    names = ("PGPASSWORD", "AWS_SECRET_ACCESS_KEY")
    secrets = {name: f"secret-{uuid.uuid4().hex}" for name in names}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    # Alice is a member with the code right only.
    with db.write() as session:
        grants.grant(session, "alice", "code")
    # Bob's things: a finished job's model, and a bundle in this host's code cache.
    bobs_model = settings.resolved_artifact_dir() / "9999" / "model.keras"
    bobs_model.parent.mkdir(parents=True)
    bobs_model.write_bytes(b"bob's model")
    benign = push(live, bundle_dir(tmp_path / "bob", BENIGN))
    cached = settings.resolved_code_dir() / code.hex_of(benign)
    assert code.tree_digest(cached) == code.hex_of(benign)

    token = f"halfway-daemon-{uuid.uuid4().hex}"
    url = settings.resolved_database_url()
    args: dict[str, Any] = {
        "sqlite": url.removeprefix("sqlite:///") if url.startswith("sqlite") else None,
        "postgres": None if url.startswith("sqlite") else url.replace("+psycopg", ""),
        "artifact": str(bobs_model),
        "cached": str(cached / "benign" / "model.py"),
        "token": token,
    }
    digest = push(live, bundle_dir(tmp_path / "alice", HOSTILE))
    spec = {
        "code": {"bundle": digest, "entrypoint": "hostile.attack:build", "args": args},
        "training": {"epochs": 1},
    }
    job_id = live.submit(spec, live.team.alice)
    job = run_until_done(live, db, settings, job_id)
    assert job["status"] == "succeeded", job["error"]
    log = job_log(live, job_id)

    # Every attack ran, and none worked (reading its own environment and starting a daemon
    # inside its sandbox do; what they reach is checked below).
    attacks = [line for line in log.splitlines() if line.startswith("attack ")]
    assert len(attacks) == 7, log
    contained = ("attack environment:", "attack daemon:")
    assert [a for a in attacks if "WORKED" in a and not a.startswith(contained)] == [], log
    # The environments it could read (its own, and whatever /proc showed it) hold no secret.
    for value in secrets.values():
        assert value not in log
    assert os.environ["PGPASSWORD"] == secrets["PGPASSWORD"]  # the server's own still does
    # The database is untouched.
    with db.read() as session:
        assert session.scalar(select(User.role).where(User.name == "alice")) == "member"
    # Bob's model and cached bundle are as they were.
    assert bobs_model.read_bytes() == b"bob's model"
    assert code.tree_digest(cached) == code.hex_of(benign)
    # Nothing the job started outlived it.
    assert processes_with(token) == []
    # And the job's own outputs reached the store.
    own = settings.resolved_artifact_dir() / str(job_id)
    assert (own / "model.keras").is_file() and (own / "train.log").is_file()
