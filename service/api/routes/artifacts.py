"""A job's artifacts (the trained model, TensorBoard events) and its training log."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel

from service.api.deps import JobId, PrincipalDep, SessionDep, SettingsDep
from service.api.responses import error_responses
from service.errors import NotFound
from service.files.storage import Store, open_storage
from service.scheduling import jobs

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

# Only these names are served: nothing a request names is ever joined to a path unchecked.
ARTIFACTS = {
    "model.keras": "application/octet-stream",
    # A code job's weights alone: its .keras file needs the bundle's custom objects to load.
    "model.weights.h5": "application/octet-stream",
    "train.log": "text/plain; charset=utf-8",
}
DEFAULT_TAIL = 64 * 1024
MAX_CHUNK = 4 * 1024 * 1024
ERRORS = error_responses(401, 404, 422)


class ArtifactOut(BaseModel):
    name: str
    bytes: int
    url: str


def artifact_store(settings: Any) -> Store:
    """The artifacts' store (HALFWAY_STORAGE_URL): files are read from it, local or S3."""
    return open_storage(settings.storage_config()).artifacts


@router.get("/{job_id}/artifacts", response_model=list[ArtifactOut], responses=ERRORS)
def list_artifacts(
    job_id: JobId, session: SessionDep, settings: SettingsDep, _: PrincipalDep
) -> list[ArtifactOut]:
    jobs.get_job(session, job_id)
    store = artifact_store(settings)
    out = []
    for name in ARTIFACTS:
        size = store.size(f"{job_id}/{name}")
        if size is not None:
            out.append(
                ArtifactOut(name=name, bytes=size, url=f"/v1/jobs/{job_id}/artifacts/{name}")
            )
    return out


@router.get(
    "/{job_id}/artifacts/{name}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **ERRORS},
)
def get_artifact(
    job_id: JobId, name: str, session: SessionDep, settings: SettingsDep, _: PrincipalDep
) -> Response:
    jobs.get_job(session, job_id)
    if name not in ARTIFACTS:
        raise NotFound(f"no artifact named {name!r}; artifacts are {', '.join(ARTIFACTS)}")
    store, key = artifact_store(settings), f"{job_id}/{name}"
    filename = f"job-{job_id}-{name}"
    local = store.local_path(key)
    if local is not None:
        if not local.is_file():
            raise NotFound(f"job {job_id} has no {name} (yet)")
        return FileResponse(local, media_type=ARTIFACTS[name], filename=filename)
    size = store.size(key)
    if size is None:
        raise NotFound(f"job {job_id} has no {name} (yet)")
    # Streamed from the store a chunk at a time: a model can be larger than the API's memory.
    return StreamingResponse(
        store.iter_bytes(key),
        media_type=ARTIFACTS[name],
        headers={
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )


@router.get(
    "/{job_id}/logs",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, **ERRORS},
)
def get_logs(
    job_id: JobId,
    session: SessionDep,
    settings: SettingsDep,
    _: PrincipalDep,
    offset: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="Read from this byte on (use X-Log-Offset to follow)."),
    ] = None,
    tail: Annotated[
        int, Query(ge=1, le=MAX_CHUNK, description="Without offset: the last this many bytes.")
    ] = DEFAULT_TAIL,
) -> Response:
    """The training log as text. ``X-Log-Offset`` is where to continue from, so a client
    follows the log by passing it back as ``offset``."""
    jobs.get_job(session, job_id)
    store, key = artifact_store(settings), f"{job_id}/train.log"
    size = store.size(key) or 0
    start = max(0, size - tail) if offset is None else min(offset, size)
    data = b""
    if size > start:
        data = store.read_range(key, start, min(size - start, MAX_CHUNK))
    return Response(
        content=data,
        media_type="text/plain; charset=utf-8",
        headers={"X-Log-Offset": str(start + len(data)), "X-Log-Size": str(size)},
    )
