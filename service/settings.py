"""Settings, read from the environment (prefix ``HALFWAY_``) at the entry point and passed down.

Nothing here runs at import time: ``Settings()`` is built by the CLI (or a test) and handed to
``create_app`` and the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.files.storage import StorageConfig, check_storage_url

DEFAULT_HOME = Path(".halfway")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HALFWAY_", extra="ignore")

    home: Path = Field(
        default=DEFAULT_HOME,
        description="Where the default SQLite file, datasets and artifacts live.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; default sqlite:///<home>/halfway.db. "
        "PostgreSQL: postgresql+psycopg://user@host/db.",
    )
    data_dir: Path | None = Field(default=None, description="Datasets; default <home>/data.")
    artifact_dir: Path | None = Field(
        default=None, description="Job artifacts; default <home>/artifacts."
    )
    code_dir: Path | None = Field(
        default=None,
        description="This host's cache of unpacked code bundles (and, without "
        "HALFWAY_STORAGE_URL, the bundles themselves); default <home>/code.",
    )
    storage_url: str | None = Field(
        default=None,
        description="Where files live: file:///path or s3://bucket/prefix (several hosts). "
        "Default: HALFWAY_DATA_DIR, HALFWAY_ARTIFACT_DIR and HALFWAY_CODE_DIR.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="An S3-compatible server (MinIO, Ceph, ...); default AWS."
    )
    s3_region: str | None = Field(default=None, description="Default: AWS_DEFAULT_REGION.")
    scratch_dir: Path | None = Field(
        default=None,
        description="Local disk where a training child stages files for a remote store; "
        "default <home>/scratch.",
    )

    host: str = "127.0.0.1"
    port: int = 8000
    embedded_worker: bool = True

    # Worker behaviour.
    lease_seconds: float = Field(default=30.0, gt=0)
    poll_seconds: float = Field(default=1.0, gt=0, description="Idle worker's queue poll.")
    cancel_grace_seconds: float = Field(default=10.0, ge=0)
    history_flush_seconds: float = Field(default=0.5, gt=0)
    hang_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="A training child silent for this long is killed (not while it compiles "
        "a step function: the start-up grace applies then).",
    )
    startup_timeout_seconds: float = Field(
        default=900.0,
        gt=0,
        description="Grace for importing TensorFlow, loading data and building, and for each "
        "step function's trace and compile.",
    )

    # Limits checked at submission, so a worker never tries an absurd job.
    max_parameters: int = Field(default=100_000_000, gt=0)
    max_dataset_elements: int = Field(default=2_000_000_000, gt=0)
    max_total_steps: int = Field(default=100_000_000, gt=0)
    max_body_bytes: int = Field(default=1_000_000, gt=0)
    max_upload_bytes: int = Field(
        default=2 * 1024**3, gt=0, description="Largest dataset upload (POST /v1/datasets)."
    )
    # Code bundles (POST /v1/code) and who may run them.
    code_jobs: Literal["admins", "members", "off"] = Field(
        default="admins",
        description="Who may upload code and run code jobs: admins (and members granted the "
        "right), every member, or nobody.",
    )
    max_code_bytes: int = Field(default=50 * 1024**2, gt=0, description="Unpacked bundle size.")
    max_code_files: int = Field(default=10_000, gt=0)
    max_code_ratio: float = Field(
        default=100.0,
        gt=1,
        description="Unpacked/compressed size above which an archive is "
        "refused as a compression bomb.",
    )
    code_isolation: Literal["auto", "bubblewrap", "none"] = Field(
        default="auto",
        description="How training children are walled off from the server: bubblewrap (user, "
        "mount, PID and network namespaces; the job sees only its own inputs and scratch), "
        "none (the server's user; announced), or auto: bubblewrap where it works, else none.",
    )
    max_running_per_user: int = Field(default=0, ge=0, description="0 means no limit.")
    fairshare_half_life: float = Field(
        default=86400.0,
        gt=0,
        description="Seconds after which a user's recorded use counts half in the fair-share "
        "order (docs/scheduling.md).",
    )
    budget_slot_hours: float = Field(
        default=0.0,
        ge=0,
        description="Slot-hours (GPU-hours) each user's jobs may start within one budget "
        "window; 0: no budget (docs/scheduling.md).",
    )
    budget_window: float = Field(
        default=7 * 86400.0,
        ge=60,
        description="Seconds in a budget window; windows are counted from Monday 1970-01-05 "
        "00:00 UTC, so a week's starts on Monday and a day's at midnight UTC.",
    )
    preemption: Literal["on", "off"] = Field(
        default="on",
        description="Preemption at checkpoints (docs/scheduling.md): off, no running job is "
        "stopped for a waiting one on this host.",
    )
    preempt_after: float = Field(
        default=1800.0,
        ge=0,
        description="Seconds a run must have lasted before a waiting job may preempt it.",
    )
    preempt_wait: float = Field(
        default=30.0,
        ge=0,
        description="Seconds a job must have waited before it may preempt a running one "
        "(so that a slot freeing elsewhere takes it first).",
    )
    poll_cache_seconds: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="Reuse a job's summary this long for polls (0: always read the database).",
    )
    api_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="How much lower than the training the API's threads run (nice "
        "increment; Linux): polls wait for a free core instead of taking one from a step.",
    )
    lean_polls: bool = Field(
        default=True,
        description="Answer polls the poll cache holds before FastAPI's routing "
        "(off: every request goes through the routes; for comparing the two).",
    )
    auth_failure_burst: int = Field(
        default=20, ge=1, description="Failed authentications a client address may make at once."
    )
    auth_failures_per_second: float = Field(
        default=1.0, gt=0, description="Then this many more per second; beyond: 429."
    )
    gpu_free_mib: int = Field(
        default=512,
        ge=0,
        description="A slot's GPUs must use at most this much memory before its next job.",
    )
    gpu_free_timeout_seconds: float = Field(default=120.0, ge=0)

    @field_validator("storage_url", "s3_endpoint_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # Compose passes an unset variable as an empty string.
        return None if value == "" else value

    @field_validator("storage_url")
    @classmethod
    def _a_store_we_open(cls, value: str | None) -> str | None:
        # Refused at startup, not on the first request or job that touches a file.
        if value is not None:
            check_storage_url(value)
        return value

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'halfway.db').resolve()}"

    def resolved_data_dir(self) -> Path:
        return (self.data_dir or self.home / "data").resolve()

    def resolved_artifact_dir(self) -> Path:
        return (self.artifact_dir or self.home / "artifacts").resolve()

    def resolved_code_dir(self) -> Path:
        return (self.code_dir or self.home / "code").resolve()

    def resolved_scratch_dir(self) -> Path:
        return (self.scratch_dir or self.home / "scratch").resolve()

    def storage_config(self) -> StorageConfig:
        return StorageConfig(
            url=self.storage_url,
            artifact_dir=str(self.resolved_artifact_dir()),
            data_dir=str(self.resolved_data_dir()),
            code_dir=str(self.resolved_code_dir()),
            s3_endpoint_url=self.s3_endpoint_url,
            s3_region=self.s3_region,
        )

    def ensure_dirs(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.resolved_data_dir().mkdir(parents=True, exist_ok=True)
        self.resolved_artifact_dir().mkdir(parents=True, exist_ok=True)
