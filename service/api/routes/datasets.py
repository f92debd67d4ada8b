"""Dataset uploads: an ``.npz`` checked from its array headers and stored under the data
directory, so specs can name it as ``data: {kind: npz, path: ...}``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Response, UploadFile
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel

from service.api.deps import PrincipalDep, SettingsDep
from service.api.responses import ErrorOut, error_responses
from service.errors import NotFound
from service.files import datasets
from service.files.storage import StorageError, check_key, open_storage

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])


class ArrayOut(BaseModel):
    shape: list[int]
    dtype: str


class DatasetOut(BaseModel):
    path: str
    bytes: int
    arrays: dict[str, ArrayOut] = {}


@router.post(
    "",
    status_code=201,
    response_model=DatasetOut,
    responses={
        **error_responses(401, 413, 422),
        409: {"model": ErrorOut, "description": "A dataset of that name exists"},
    },
)
def upload_dataset(
    file: Annotated[UploadFile, File(description="An .npz with x_train, y_train[, x_val, y_val]")],
    name: Annotated[str, Form(min_length=1, max_length=100, pattern=datasets.NAME.pattern)],
    principal: PrincipalDep,
    settings: SettingsDep,
) -> DatasetOut:
    path, infos, size = datasets.store(
        file.file,
        name=name,
        owner=principal.name,
        data=open_storage(settings.storage_config()).data,
        max_bytes=settings.max_upload_bytes,
    )
    return DatasetOut(
        path=path,
        bytes=size,
        arrays={k: ArrayOut(shape=list(v.shape), dtype=v.dtype) for k, v in infos.items()},
    )


@router.get("", response_model=list[DatasetOut], responses=error_responses(401))
def list_datasets(settings: SettingsDep, _: PrincipalDep) -> list[dict[str, Any]]:
    return datasets.listing(open_storage(settings.storage_config()).data)


@router.get(
    "/{path:path}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        **error_responses(401, 404, 422),
    },
)
def download_dataset(
    path: Annotated[
        str,
        PathParam(
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*\.npz$",
            max_length=1000,
            description="The dataset's path, as GET /v1/datasets lists it.",
        ),
    ],
    settings: SettingsDep,
    _: PrincipalDep,
) -> Response:
    """A dataset's .npz, as a spec names it (``uploads/alice/blobs.npz``), streamed out of the
    data store."""
    try:
        key = check_key(path)
    except StorageError:
        raise NotFound(f"no dataset {path!r}") from None
    store = open_storage(settings.storage_config()).data
    size = store.size(key) if key.endswith(".npz") else None
    if size is None:
        raise NotFound(f"no dataset {path!r}")
    filename = key.rsplit("/", 1)[-1]
    local = store.local_path(key)
    if local is not None:
        return FileResponse(local, media_type="application/octet-stream", filename=filename)
    return StreamingResponse(
        store.iter_bytes(key),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(size),
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )
