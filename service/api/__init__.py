"""The HTTP layer: ``app.create_app`` builds the FastAPI application; ``routes/`` holds one
module per resource; ``leanpolls`` answers dashboards' polls before routing; ``feeds`` fans the
event stream out; ``pages`` and ``responses`` build what the API answers; ``etag`` and
``pollcache`` keep polls cheap; ``openapi`` and ``docs_pages`` serve the API's own docs.
Nothing outside this folder (but ``service.cli``) imports it."""
