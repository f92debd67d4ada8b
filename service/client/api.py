"""``Client``: Halfway's public Python API, over HTTP (httpx). The ``halfway`` commands are
built on it, and notebooks use it directly::

    from service.client import Client

    hw = Client()                      # URL and token as the CLI finds them
    job = hw.submit(spec)
    hw.wait(job["id"], on_progress=lambda j: print(j["progress"]["step"]))
    df = hw.history(job["id"])         # every step: step, epoch, loss, loss_scale, finite
    per_epoch = hw.metrics(job["id"])  # a row per epoch: loss, accuracy, val_loss, ...
    grads = hw.gradients(job["id"])    # each sampled step's gradient figures, per variable

Every failure is a typed exception from ``service.client.errors`` (``Unauthorized``,
``Forbidden``, ``NotFound``, ``Conflict``, ``Invalid``, ``Unreachable``, ...)."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import httpx

from service.client import codepack
from service.client.config import resolve_target
from service.client.errors import (
    HalfwayError,
    ServerError,
    Unreachable,
    UsageError,
)
from service.client.frames import gradients_frame, metrics_frame, require_pandas, sweep_frame
from service.client.responses import api_error, response_json, unreachable
from service.vocabulary import FINISHED_STATUSES

if TYPE_CHECKING:
    import pandas

Job: TypeAlias = dict[str, Any]
HISTORY_COLUMNS = ("step", "epoch", "loss", "loss_scale", "finite")
# wait() survives a server restart or a database blip this long before giving up.
WAIT_PATIENCE_SECONDS = 60.0
TRANSIENT: tuple[type[HalfwayError], ...] = (Unreachable, ServerError)


class Client:
    """One server, one token. ``url``/``token`` default as the CLI's do: the environment
    (``HALFWAY_URL``/``HALFWAY_TOKEN``), then the config file, then ``http://127.0.0.1:8000``."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.target = resolve_target(url, token, env)
        headers = {"User-Agent": "halfway-client"}
        if self.target.token:
            headers["Authorization"] = f"Bearer {self.target.token}"
        self._http = httpx.Client(
            base_url=self.target.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
        )

    @property
    def url(self) -> str:
        return self.target.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------
    # Transport

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int | float | bool] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, params=params, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise unreachable(self.target.url, exc) from None
        if response.status_code >= 400:
            raise api_error(response, self.target)
        return response

    @contextlib.contextmanager
    def stream(
        self, path: str, params: Mapping[str, str | int] | None = None
    ) -> Iterator[httpx.Response]:
        try:
            with self._http.stream("GET", path, params=params) as response:
                if response.status_code >= 400:
                    response.read()
                    raise api_error(response, self.target)
                yield response
        except httpx.TransportError as exc:
            raise unreachable(self.target.url, exc) from None

    def _get_json(self, path: str, params: Mapping[str, str | int] | None = None) -> Any:
        return response_json(self.request("GET", path, params=params))

    # ----------------------------------------------------------------------------------------
    # Jobs

    def post_job(
        self,
        spec: Mapping[str, Any],
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """The job (for a dry run: the normalized spec with its warnings and notes), and
        whether the server replayed the job first submitted with ``idempotency_key``."""
        response = self.request(
            "POST",
            "/v1/jobs",
            params={"dry_run": "true"} if dry_run else None,
            body=dict(spec),
            headers={"Idempotency-Key": idempotency_key} if idempotency_key else None,
        )
        return response_json(response), response.headers.get("Idempotent-Replayed") == "true"

    def submit(
        self,
        spec: Mapping[str, Any],
        code_dir: str | Path | None = None,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Submit a job spec (a mapping, as in a spec file) and return the job. A dry run
        validates and normalizes it and stores nothing. With ``code_dir``, that folder is
        packed and uploaded first and its digest fills the spec's ``code.bundle``."""
        if code_dir is not None:
            spec = with_bundle(spec, self.push_code(code_dir)["digest"])
        job, _ = self.post_job(spec, dry_run=dry_run, idempotency_key=idempotency_key)
        return job

    # ----------------------------------------------------------------------------------------
    # Code bundles

    def upload_code(self, archive: bytes) -> tuple[dict[str, Any], bool]:
        """The bundle (digest, files, bytes) and whether it was new (201) or known (200)."""
        try:
            response = self._http.post(
                "/v1/code",
                files={"file": ("bundle.tar.gz", archive, "application/gzip")},
                timeout=httpx.Timeout(300.0, connect=5.0),
            )
        except httpx.TransportError as exc:
            raise unreachable(self.target.url, exc) from None
        if response.status_code >= 400:
            raise api_error(response, self.target)
        return response_json(response), response.status_code == 201

    def push_code(self, directory: str | Path) -> dict[str, Any]:
        """Pack ``directory`` (skipping .git, __pycache__, virtual environments and what
        ``.halfwayignore`` names) and upload it: ``{"digest", "files", "bytes", "created"}``."""
        root = Path(directory)
        if not root.is_dir():
            raise UsageError(f"--code {directory}: not a directory")
        if not codepack.files(root):
            raise UsageError(f"{directory} holds no files to pack")
        bundle, created = self.upload_code(codepack.pack(root))
        return {**bundle, "created": created}

    def code(self, digest: str) -> dict[str, Any]:
        """A stored bundle's files."""
        listed: dict[str, Any] = self._get_json(f"/v1/code/{digest}")
        return listed

    def job(self, job_id: int) -> Job:
        job: Job = self._get_json(f"/v1/jobs/{job_id}")
        return job

    def job_if_changed(self, job_id: int, etag: str | None) -> tuple[Job | None, str | None]:
        """The job, or None when it has not changed since ``etag`` (the server's 304)."""
        response = self.request(
            "GET", f"/v1/jobs/{job_id}", headers={"If-None-Match": etag} if etag else None
        )
        if response.status_code == 304:
            return None, etag
        return response_json(response), response.headers.get("ETag")

    def jobs(
        self,
        *,
        status: str | None = None,
        owner: str | None = None,
        limit: int = 20,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """One page of jobs, newest first: ``{"items": [...], "next_cursor": ...}``."""
        params: dict[str, str | int] = {"limit": limit}
        for key, value in (("status", status), ("owner", owner), ("cursor", cursor)):
            if value is not None:
                params[key] = value
        page: dict[str, Any] = self._get_json("/v1/jobs", params)
        return page

    def cancel(self, job_id: int) -> Job:
        job: Job = response_json(self.request("POST", f"/v1/jobs/{job_id}/cancel"))
        return job

    def wait(
        self,
        job_id: int,
        on_progress: Callable[[Job], None] | None = None,
        *,
        poll_seconds: float = 1.0,
        patience_seconds: float = WAIT_PATIENCE_SECONDS,
        on_retry: Callable[[HalfwayError], None] | None = None,
    ) -> Job:
        """Poll until the job has finished and return it. ``on_progress`` is called with the
        job each time it changes (an unchanged job costs an empty 304). A server that is
        briefly unreachable or failing is retried for ``patience_seconds`` (``on_retry`` is
        told each time)."""
        etag: str | None = None
        while True:
            job, etag = self._poll_patiently(job_id, etag, patience_seconds, poll_seconds, on_retry)
            if job is not None:
                if on_progress is not None:
                    on_progress(job)
                if job["status"] in FINISHED_STATUSES:
                    return job
            time.sleep(poll_seconds)

    def poll_job(
        self,
        job_id: int,
        etag: str | None,
        *,
        patience_seconds: float = WAIT_PATIENCE_SECONDS,
        retry_seconds: float = 1.0,
        on_retry: Callable[[HalfwayError], None] | None = None,
    ) -> tuple[Job | None, str | None]:
        """``job_if_changed``, retrying a server that is briefly unreachable or failing every
        ``retry_seconds`` for ``patience_seconds`` (``on_retry`` is told each time)."""
        return self._poll_patiently(job_id, etag, patience_seconds, retry_seconds, on_retry)

    def _poll_patiently(
        self,
        job_id: int,
        etag: str | None,
        patience: float,
        pause: float,
        on_retry: Callable[[HalfwayError], None] | None,
    ) -> tuple[Job | None, str | None]:
        deadline = time.monotonic() + patience
        while True:
            try:
                return self.job_if_changed(job_id, etag)
            except TRANSIENT as exc:
                if time.monotonic() > deadline:
                    raise
                if on_retry is not None:
                    on_retry(exc)
                time.sleep(pause)

    # ----------------------------------------------------------------------------------------
    # History

    def history_page(self, job_id: int, *, after_step: int = -1, limit: int = 1000) -> Job:
        """Raw rows after ``after_step``: ``{"items": [...], "next_after_step", "has_more"}``."""
        page: dict[str, Any] = self._get_json(
            f"/v1/jobs/{job_id}/history", {"after_step": after_step, "limit": limit}
        )
        return page

    def history(
        self, job_id: int, *, from_step: int | None = None, to_step: int | None = None
    ) -> pandas.DataFrame:
        """Every step of the job (or of ``from_step``..``to_step``) as a DataFrame with columns
        step, epoch, loss, loss_scale, finite; non-finite losses are NaN and ±inf. It is read
        as one Arrow stream (the fastest way out of the server). Needs pandas:
        ``pip install 'halfway[client]'``."""
        require_pandas("Client.history()")
        import pandas as pd
        import pyarrow as pa

        with self.stream(f"/v1/jobs/{job_id}/history.arrow", _range(from_step, to_step)) as r:
            table = pa.ipc.open_stream(r.read()).read_all()
        frame: pd.DataFrame = table.to_pandas()
        # float32 on the server (as TensorFlow computed them); float64 holds them exactly.
        return frame[list(HISTORY_COLUMNS)].astype(
            {"step": "int64", "epoch": "int64", "loss": "float64", "loss_scale": "float64"}
        )

    def download_history(
        self,
        job_id: int,
        fmt: str,
        file: str | Path,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> int:
        """Stream the history as ``fmt`` (``arrow`` or ``parquet``) into ``file``; the bytes
        written. It goes to a temporary file beside it, renamed at the end, so a failed
        download never leaves half a file under the name."""
        if fmt not in ("arrow", "parquet"):
            raise UsageError(f"unknown history format {fmt!r}: arrow or parquet")
        target = Path(file)
        partial = target.with_name(f".{target.name}.partial")
        written = 0
        path = f"/v1/jobs/{job_id}/history.{fmt}"
        try:
            with (
                self.stream(path, _range(from_step, to_step)) as response,
                partial.open("wb") as out,
            ):
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
            partial.replace(target)
        except OSError as exc:
            raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
        finally:
            partial.unlink(missing_ok=True)
        return written

    def buckets(
        self,
        job_id: int,
        points: int,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> dict[str, Any]:
        """At most ``points`` buckets with min/max/last loss and scale and overflow counts."""
        params: dict[str, str | int] = {"points": points}
        if from_step is not None:
            params["from_step"] = from_step
        if to_step is not None:
            params["to_step"] = to_step
        page: dict[str, Any] = self._get_json(f"/v1/jobs/{job_id}/history", params)
        return page

    def scale_events(self, job_id: int) -> list[dict[str, Any]]:
        """Each change of the loss scale, oldest first, with its reason (overflow or growth)."""
        events: list[dict[str, Any]] = []
        after = -1
        while True:
            page = self._get_json(
                f"/v1/jobs/{job_id}/loss-scale/events", {"after_step": after, "limit": 10_000}
            )
            events += page["items"]
            if not page["has_more"] or page["next_after_step"] is None:
                return events
            after = page["next_after_step"]

    @contextlib.contextmanager
    def history_csv(self, job_id: int) -> Iterator[Iterator[bytes]]:
        """The history as the server's CSV bytes, streamed."""
        with self.stream(f"/v1/jobs/{job_id}/history.csv") as response:
            yield response.iter_bytes()

    def metrics(self, job_id: int) -> pandas.DataFrame:
        """Each ended epoch's metrics (``GET /v1/jobs/{id}/metrics``): a row per epoch,
        indexed by the 0-based epoch, a float64 column per metric (loss, accuracy, val_loss,
        ...; NaN where the server has none). Needs pandas (``halfway[client]``)."""
        require_pandas("Client.metrics()")
        return metrics_frame(self._get_json(f"/v1/jobs/{job_id}/metrics"))

    # ----------------------------------------------------------------------------------------
    # Gradient samples

    def gradient_page(self, job_id: int, *, after_step: int = -1, limit: int = 200) -> Job:
        """Samples after ``after_step``, each with its ``variables``: ``{"job_id",
        "history_version", "samples": [...], "next_after_step"}`` (None: no more yet)."""
        page: dict[str, Any] = self._get_json(
            f"/v1/jobs/{job_id}/gradients", {"after_step": after_step, "limit": limit}
        )
        return page

    def gradients(self, job_id: int) -> pandas.DataFrame:
        """Every gradient sample of the job as a long DataFrame: a row per (step, variable),
        the whole model's with variable "(model)"; columns step, variable, loss_scale, shadow,
        finite, zero_share, log2_max, log2_min_nonzero, headroom, subnormal_share,
        underflow_share, lost_share, relative_error (the last three NaN where the float32
        shadow did not run). Read as one Parquet file. Needs pandas (``halfway[client]``)."""
        require_pandas("Client.gradients()")
        with self.stream(f"/v1/jobs/{job_id}/gradients", {"format": "parquet"}) as response:
            return gradients_frame(response.read())

    # ----------------------------------------------------------------------------------------
    # Logs, artifacts, sweeps

    def logs(self, job_id: int, offset: int | None = None) -> tuple[bytes, int]:
        """Log bytes from ``offset`` (None: the tail) and the offset to continue from."""
        params = {"offset": offset} if offset is not None else None
        response = self.request("GET", f"/v1/jobs/{job_id}/logs", params=params)
        try:
            after = int(response.headers["X-Log-Offset"])
        except (KeyError, ValueError):
            raise ServerError("the server sent no X-Log-Offset with the log") from None
        return response.content, after

    def artifacts(self, job_id: int) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = self._get_json(f"/v1/jobs/{job_id}/artifacts")
        return listed

    def create_sweep(self, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = response_json(self.request("POST", "/v1/sweeps", body=dict(body)))
        return created

    def get_sweep(self, sweep_id: int) -> dict[str, Any]:
        table: dict[str, Any] = self._get_json(f"/v1/sweeps/{sweep_id}")
        return table

    def start_sweep(
        self,
        spec: Mapping[str, Any],
        *,
        policies: Sequence[str] | None = None,
        target_loss: float | None = None,
        code_dir: str | Path | None = None,
    ) -> dict[str, Any]:
        """Create a sweep and return at once with the API's JSON: ``{"id", "name", "done",
        "variants": [{"job_id", "name", "status", ...}]}``. ``sweep`` says the rest."""
        body: dict[str, Any] = (
            dict(spec) if "base" in spec or "variants" in spec else {"base": dict(spec)}
        )
        if code_dir is not None:
            body["base"] = with_bundle(body.get("base", {}), self.push_code(code_dir)["digest"])
        if policies:
            body["policies"] = list(policies)
        if target_loss is not None:
            body["target_loss"] = target_loss
        return self.create_sweep(body)

    def sweep(
        self,
        spec: Mapping[str, Any],
        *,
        policies: Sequence[str] | None = None,
        target_loss: float | None = None,
        wait: bool = True,
        poll_seconds: float = 2.0,
        code_dir: str | Path | None = None,
    ) -> pandas.DataFrame:
        """One job per precision variant of ``spec`` (a job spec, or a sweep spec with
        ``base`` and ``variants``), compared side by side: a DataFrame with a row per variant
        (indexed by its name) and the comparison fields as columns (``sweep_frame``). With
        ``wait``, once every variant has finished. ``code_dir`` as for ``submit`` (the base's
        code). The sweep's id is ``frame.attrs["sweep_id"]``: ``sweep_results(id)`` reads it
        again, ``get_sweep(id)`` as the API's JSON. Needs pandas (``halfway[client]``)."""
        require_pandas("Client.sweep()")  # before any job is queued
        table = self.start_sweep(
            spec, policies=policies, target_loss=target_loss, code_dir=code_dir
        )
        while wait and not table["done"]:
            time.sleep(poll_seconds)
            table = self.get_sweep(table["id"])
        return sweep_frame(table)

    def sweep_results(self, sweep_id: int) -> pandas.DataFrame:
        """A sweep's comparison now, as ``sweep`` returns it (``frame.attrs["done"]`` says
        whether every variant has finished)."""
        return sweep_frame(self.get_sweep(sweep_id))


def _range(from_step: int | None, to_step: int | None) -> dict[str, str | int] | None:
    params: dict[str, str | int] = {
        k: v for k, v in (("from_step", from_step), ("to_step", to_step)) if v is not None
    }
    return params or None


def with_bundle(spec: Mapping[str, Any], digest: str) -> dict[str, Any]:
    """A copy of ``spec`` whose ``code.bundle`` is ``digest``; the spec must have a ``code``
    section naming at least its entry point."""
    section = spec.get("code")
    if not isinstance(section, Mapping):
        raise UsageError(
            "--code needs a 'code' section in the spec naming at least its entrypoint "
            "(package.module:function)"
        )
    copied = copy.deepcopy(dict(spec))
    copied["code"]["bundle"] = digest
    return copied
