"""Where a training child runs: the environment it is given and the walls around it.

Every job (preset, Keras config or the user's own code) runs the same way: the supervisor
stages its inputs into a scratch folder, then starts ``python -m workers.entry`` with

- an environment built from an allow-list (``child_env``): what Python, TensorFlow, the
  BLAS libraries and the GPU need. Never the database URL, store credentials, tokens or any
  ``HALFWAY_`` setting;
- under ``bubblewrap`` (the default where it works), new user, mount, PID, IPC, UTS, cgroup
  and network namespaces (``command``). The child sees a read-only system (``/usr`` and the
  few ``/etc`` files programs need), the Python installation and Halfway's own packages
  read-only, its inputs read-only under ``/inputs`` and its scratch read-write at ``/job``,
  and nothing else: no database file or socket (no network at all), no other job's files, no
  code cache, no other process (its own ``/proc``). It runs in a PID namespace of its own,
  so when it ends, the kernel ends everything it started, detached daemons included;
- under ``none``, the same environment and the same folders by their host paths, as the
  server's user. Announced at startup and recorded on every job, never silent.

``HALFWAY_CODE_ISOLATION``: ``auto`` (bubblewrap when a probe of it works on this host, else
none, announced), ``bubblewrap`` (required: a worker that cannot use it does not start) or
``none``. No TensorFlow here.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Mode = Literal["bubblewrap", "none"]
Setting = Literal["auto", "bubblewrap", "none"]

# Inside the sandbox, a job's folders always have these names, whatever the host's are.
JOB = Path("/job")
INPUTS = Path("/inputs")
DATA = INPUTS / "data"
CODE = INPUTS / "code"
KERAS = INPUTS / "keras"

# The child's environment: these names, and names with these prefixes, pass from the
# worker's environment; nothing else does. Kept short on purpose: each is a setting of
# Python, the C library, TensorFlow/XLA, a BLAS or thread pool, or the NVIDIA driver.
ALLOWED_NAMES = frozenset(
    {
        "LANG",
        "LANGUAGE",
        "TZ",
        "LD_LIBRARY_PATH",
        "PYTHONHASHSEED",
        "KERAS_BACKEND",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
    }
)
ALLOWED_PREFIXES = ("LC_", "TF_", "XLA_", "OMP_", "OPENBLAS_", "MKL_", "NVIDIA_")

WEAK_WARNING = (
    "this job ran without isolation (HALFWAY_CODE_ISOLATION resolved to none: {why}): its "
    "code ran as the server's user and could read the server's files and database; only "
    "its environment was cleaned"
)


class IsolationUnavailable(RuntimeError):
    """``HALFWAY_CODE_ISOLATION=bubblewrap`` on a host where bubblewrap cannot run."""


@dataclass(frozen=True)
class Isolation:
    """The mode this worker uses, and why (for the startup line and each job's warning)."""

    mode: Mode
    why: str

    @property
    def warning(self) -> str | None:
        return None if self.mode == "bubblewrap" else WEAK_WARNING.format(why=self.why)


def resolve(setting: Setting) -> Isolation:
    """The strongest mode the setting allows on this host."""
    if setting == "none":
        return Isolation("none", "HALFWAY_CODE_ISOLATION=none")
    problem = probe()
    if problem is None:
        return Isolation("bubblewrap", "user, mount, PID and network namespaces")
    if setting == "bubblewrap":
        raise IsolationUnavailable(
            f"HALFWAY_CODE_ISOLATION=bubblewrap, but {problem}. Install bubblewrap "
            "(apt-get install bubblewrap) and allow user namespaces; in a container, see "
            "the operating guide for the options it needs"
        )
    return Isolation("none", f"auto, and {problem}")


@functools.cache
def probe() -> str | None:
    """None when bubblewrap can make the sandbox here; else what stops it. Run once per
    process: the answer does not change while a worker runs."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not installed"
    try:
        done = subprocess.run(
            [bwrap, *_walls(), *_system(), "--", "/bin/true"],
            env={},
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run ({exc})"
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip() or f"exit code {done.returncode}"
        return f"bwrap cannot make a sandbox here ({said})"
    return None


# ------------------------------------------------------------------------------------------
# The environment


def child_env(
    source: Mapping[str, str], *, home: Path, gpu_ids: list[int], extra: Mapping[str, str] = {}
) -> dict[str, str]:
    """The child's whole environment: the allow-listed names from ``source`` (the worker's
    own), and what the job needs (its home, its GPUs only)."""
    env = {k: v for k, v in source.items() if k in ALLOWED_NAMES or k.startswith(ALLOWED_PREFIXES)}
    env.update(
        PATH="/usr/local/bin:/usr/bin:/bin",
        HOME=str(home),
        TMPDIR=str(home / "tmp"),
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        # Only this job's GPUs are visible (none for a CPU job, so it cannot take one by
        # accident), and memory is taken as needed rather than all at once.
        CUDA_VISIBLE_DEVICES=",".join(str(g) for g in gpu_ids) if gpu_ids else "-1",
        TF_FORCE_GPU_ALLOW_GROWTH="true",
        TF_CPP_MIN_LOG_LEVEL=source.get("TF_CPP_MIN_LOG_LEVEL", "1"),
    )
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------
# The walls


@dataclass(frozen=True)
class Mounts:
    """What one job's sandbox holds besides the system: host path -> path inside."""

    scratch: Path  # read-write, at /job
    inputs: tuple[tuple[Path, Path], ...]  # read-only
    code_roots: tuple[Path, ...]  # Python and Halfway's packages, read-only, same path


def command(argv: list[str], mounts: Mounts) -> list[str]:
    """The bwrap command line that runs ``argv`` in the job's sandbox. ``--json-status-fd``
    is added by the launcher (it reads the child's pid from it). bwrap is started with the
    child's environment (``child_env``) and passes it on as it is."""
    bwrap = shutil.which("bwrap") or "bwrap"
    args = [bwrap, *_walls(), *_system()]
    for root in mounts.code_roots:
        args += ["--ro-bind", str(root), str(root)]
    for host, inside in mounts.inputs:
        args += ["--ro-bind", str(host), str(inside)]
    args += ["--bind", str(mounts.scratch), str(JOB), "--chdir", str(JOB)]
    for device in _gpu_devices():
        args += ["--dev-bind", str(device), str(device)]
    return [*args, "--", *argv]


def _walls() -> list[str]:
    # bwrap's own small init is PID 1 of the namespace and the child its first process: when
    # the child ends, the init ends, and the kernel ends every process left in the namespace
    # (a daemon in a new session included); SIGKILL to the init ends them all at once.
    # --die-with-parent: a dead supervisor (or Ray actor) takes the sandbox with it.
    # --new-session: no way to push keystrokes into the server's terminal (TIOCSTI).
    return [
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--hostname",
        "halfway-job",
    ]


# What of /etc a Python program and TensorFlow read: the loader's cache, users and groups
# (no passwords), time zone, locale and TLS roots. Nothing else (no shadow, no keys).
_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "passwd",
    "group",
    "nsswitch.conf",
    "localtime",
    "timezone",
    "locale.alias",
    "alternatives",
    "ssl",
    "ca-certificates",
    "mime.types",
)


@functools.cache
def _system() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    args += ["--tmpfs", "/tmp", "--dir", str(INPUTS)]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in _ETC:
        path = Path("/etc") / name
        if path.exists():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _gpu_devices() -> list[Path]:
    """The NVIDIA device nodes (the driver's libraries are under /usr, bound already)."""
    return sorted(Path("/dev").glob("nvidia*"))


def code_roots(extra_modules: Iterable[str] = ()) -> tuple[Path, ...]:
    """The folders the child's Python needs: the interpreter's installation, the
    environment's (a venv), and the top folders of Halfway's packages and of the trainer's
    module when those are not installed into the environment (an editable install, tests).
    Never the folder above them: a repository's root may hold the database."""
    roots = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    for name in ("service", "workers", *extra_modules):
        module = sys.modules.get(name.partition(".")[0])
        file = getattr(module, "__file__", None)
        if file is not None:
            roots.add(Path(file).resolve().parent)
    # Drop a root inside another (bound twice, the inner bind would hide nothing, but the
    # command line is shorter and the walls easier to read).
    return tuple(sorted(r for r in roots if not any(r != o and r.is_relative_to(o) for o in roots)))


def python_path(roots: Iterable[Path]) -> str:
    """PYTHONPATH for the child: the parents of package folders that live outside the
    environment, so ``import workers`` (and a test's trainer module) resolve."""
    prefixes = (Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve())
    parents = sorted(
        {str(r.parent) for r in roots if not any(r.is_relative_to(p) for p in prefixes)}
    )
    return os.pathsep.join(parents)
