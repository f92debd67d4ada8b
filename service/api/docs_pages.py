"""The API's documentation pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), drawn from
files shipped in this package, so they work on a server with no way out to the internet.

FastAPI's default pages load their scripts, styles, fonts and favicon from CDNs: offline they
are blank. These are FastAPI's own pages (``get_swagger_ui_html``, ``get_redoc_html``) pointed
at copies under ``static/vendor/`` and served by the dashboard's ``/static`` mount.

Why vendored from npm rather than a PyPI package that carries the files (fastapi-offline):
that package records neither which Swagger UI and ReDoc builds it holds nor their licenses,
and offers only a factory for a plain ``FastAPI`` (the app is a ``HalfwayAPI``), so using it
would mean reaching into its private folder. uPlot is already vendored the same way; each
folder's VERSION names the npm release and checksums, and how to upgrade in three steps.

As before, the pages and ``/openapi.json`` need no token: the document is no secret, and the
page's "Authorize" button takes the user's bearer token for the calls it makes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
SWAGGER_JS = "/static/vendor/swagger-ui/swagger-ui-bundle.js"
SWAGGER_CSS = "/static/vendor/swagger-ui/swagger-ui.css"
REDOC_JS = "/static/vendor/redoc/redoc.standalone.js"
# Swagger UI's own icon, for both pages (ReDoc's package ships none).
FAVICON = "/static/vendor/swagger-ui/favicon-32x32.png"
# ReDoc 2's side menu shows Redocly's logo from cdn.redoc.ly, unconditionally (it hides the
# image when the load fails). Images from this server and data: URLs only, so no request
# leaves for it; the same on /docs, should a later Swagger UI do likewise. Scripts and styles
# are left alone: both pages run inline ones.
PAGE_HEADERS = {"Content-Security-Policy": "img-src 'self' data:"}


def _root(request: Request) -> str:
    """The prefix a proxy mounts the app under (``--root-path``), as FastAPI's pages use it:
    every URL the browser is given must carry it."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def install(app: FastAPI) -> None:
    """Add the pages to an app built with ``docs_url=None, redoc_url=None`` (so FastAPI adds
    none of its CDN ones), with the same titles, parameters and OAuth2 redirect page."""
    openapi_url = app.openapi_url
    assert openapi_url, "the pages show the OpenAPI document; the app must serve one"
    redirect_url = app.swagger_ui_oauth2_redirect_url

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        page = get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=root + SWAGGER_JS,
            swagger_css_url=root + SWAGGER_CSS,
            swagger_favicon_url=root + FAVICON,
            oauth2_redirect_url=root + redirect_url if redirect_url else None,
            init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers.update(PAGE_HEADERS)
        return page

    if redirect_url:

        @app.get(redirect_url, include_in_schema=False)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        page = get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=root + REDOC_JS,
            redoc_favicon_url=root + FAVICON,
            # Google Fonts is the one other thing the page fetches; ReDoc falls back to the
            # system's sans-serif.
            with_google_fonts=False,
        )
        page.headers.update(PAGE_HEADERS)
        return page
