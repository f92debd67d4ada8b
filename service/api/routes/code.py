"""Code bundles: ``POST /v1/code`` checks an archive and puts its bundle in the store,
content-addressed; ``GET /v1/code/{digest}`` lists what the store's bundle holds. Nothing
here imports the code."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Path, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.api.responses import ErrorOut, error_responses
from service.files import code, codestore
from service.files.storage import Store, open_storage
from service.people import grants
from service.settings import Settings

router = APIRouter(prefix="/v1/code", tags=["code"])

DIGEST = r"^sha256:[0-9a-f]{64}$"


class BundleOut(BaseModel):
    digest: str = Field(description="sha256:<hex> over the unpacked files' paths and contents.")
    files: int
    bytes: int = Field(description="Unpacked size.")


class BundleFile(BaseModel):
    path: str
    bytes: int


class BundleListing(BundleOut):
    listing: list[BundleFile]


def limits(settings: Settings) -> code.Limits:
    return code.Limits(
        max_bytes=settings.max_code_bytes,
        max_files=settings.max_code_files,
        max_ratio=settings.max_code_ratio,
    )


def code_store(settings: Settings) -> Store:
    return open_storage(settings.storage_config()).code


@router.post(
    "",
    status_code=201,
    response_model=BundleOut,
    responses={
        200: {"model": BundleOut, "description": "The same content was stored before"},
        403: {"model": ErrorOut, "description": "This user may not upload code"},
        **error_responses(401, 413, 422),
    },
)
def upload_code(
    file: Annotated[UploadFile, File(description="A .zip or .tar.gz of the code's directory.")],
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
) -> JSONResponse:
    grants.require_code_right(session, principal, settings.code_jobs)
    bundle = codestore.upload(
        file.file, code_store(settings), settings.resolved_code_dir(), limits(settings)
    )
    body = BundleOut(digest=bundle.digest, files=bundle.files, bytes=bundle.bytes)
    return JSONResponse(
        body.model_dump(),
        status_code=201 if bundle.created else 200,
        headers={"Location": f"/v1/code/{bundle.digest}"},
    )


@router.get(
    "/{digest}",
    response_model=BundleListing,
    responses={
        **error_responses(401, 404, 422),
        409: {"model": ErrorOut, "description": "The store's object is damaged: upload again"},
    },
)
def get_code(
    digest: Annotated[str, Path(pattern=DIGEST, description="sha256:<64 hex digits>")],
    settings: SettingsDep,
    _: PrincipalDep,
) -> BundleListing:
    found = codestore.listing(code_store(settings), settings.resolved_code_dir(), digest)
    files = [BundleFile(path=p, bytes=n) for p, n in found]
    return BundleListing(
        digest=digest, files=len(files), bytes=sum(f.bytes for f in files), listing=files
    )
