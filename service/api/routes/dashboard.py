"""The web dashboard: static files served by the API at ``/``. The page itself needs no token;
every API call it makes sends the user's bearer token."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC = Path(__file__).resolve().parents[2] / "static"

# The page shows user-controlled text (job names, errors). It never inserts it as markup, and
# this policy is the second line: no inline script, no script from elsewhere, no framing.
# Inline styles stay allowed because uPlot positions its cursor and legend with them.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

PAGE_HEADERS = {
    # Revalidate each load, so an upgraded server never runs with stale modules.
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    # The first visit's URL carries ?token=; never send it on as a Referer.
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


class RevalidatedStaticFiles(StaticFiles):
    """Static files that the browser must revalidate (a cheap 304 by ETag) before reuse."""

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        if isinstance(response, FileResponse) and str(full_path).endswith(".js"):
            # The dashboard's script is ES modules, which a browser runs only when served with
            # a JavaScript type (nosniff below); the host's MIME table may say otherwise.
            response.headers["Content-Type"] = "text/javascript; charset=utf-8"
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def mount_static(app: FastAPI) -> None:
    app.mount("/static", RevalidatedStaticFiles(directory=STATIC), name="static")
