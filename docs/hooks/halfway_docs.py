"""MkDocs hooks for Halfway's site (``hooks:`` in mkdocs.yml).

- The job spec reference is generated from the pydantic models in ``service.specs.schemas`` at
  build time, never copied by hand: ``docs/spec.md`` holds the prose and a marker, and this
  hook puts a table per model (field, type, default, constraints, description) in its place.
- The OpenAPI document is written into the built site as ``openapi.json``, from the same
  ``create_app`` that ``halfway serve`` runs (the API never imports TensorFlow, so neither
  does the build).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

SPEC_PAGE = "spec.md"
MARKER = "<!-- halfway:spec-reference -->"
OPENAPI_FILE = "openapi.json"
CONSTRAINTS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "multiple_of": "multiple of",
    "min_length": "min length",
    "max_length": "max length",
}


def anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def submodels(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models an annotation refers to, in the order it names them."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in get_args(annotation):
        yield from submodels(arg)


def models_in_order(
    root: type[BaseModel], path: str = ""
) -> list[tuple[type[BaseModel], list[str]]]:
    """Every model reachable from ``root``, breadth first, with the spec paths it sits at."""
    seen: dict[type[BaseModel], list[str]] = {root: [path] if path else []}
    queue = [(root, path)]
    while queue:
        model, at = queue.pop(0)
        for name, field in model.model_fields.items():
            here = f"{at}.{name}" if at else name
            for sub in submodels(field.annotation):
                if sub in seen:
                    if here not in seen[sub]:
                        seen[sub].append(here)
                    continue
                seen[sub] = [here]
                queue.append((sub, here))
    return list(seen.items())


def type_name(annotation: Any) -> str:
    """A type as a spec author reads it (JSON words), sub-models linked to their table."""
    if annotation is None or annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{anchor(annotation)})"
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_name(a) for a in args))
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        if " or " in inner:
            inner = f"({inner})"
        return f"list of {inner}" if inner else "list"
    if origin is dict:
        return "object"
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in simple:
        return simple[annotation]
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def cell(text: str) -> str:
    """Text that stays inside one table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def default_of(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return ""
    if isinstance(value, BaseModel):
        return f"[{type(value).__name__}](#{anchor(type(value))}) defaults"
    return f"`{cell(json.dumps(value, default=str))}`"


def number(value: Any) -> str:
    """A bound as people write it: 2^-24 rather than 5.96046e-08."""
    if isinstance(value, float):
        mantissa, exponent = math.frexp(value)
        if mantissa == 0.5 and abs(exponent - 1) >= 16:
            return f"2^{exponent - 1}"
        return f"{value:g}"
    return str(value)


def constraints_of(field: FieldInfo) -> str:
    found: list[str] = []
    for meta in field.metadata:
        for attr, word in CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} {number(value)}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            found.append(f"pattern `{cell(str(pattern))}`")
    return ", ".join(found)


def docstring(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")
    if not own:
        return ""
    return re.sub(r"``([^`]+)``", r"`\1`", inspect.cleandoc(own))


def model_table(model: type[BaseModel], paths: list[str]) -> list[str]:
    title = model.__name__
    where = ", ".join(f"`{p}`" for p in paths)
    out = [f"### {title} {{#{anchor(model)}}}", ""]
    if where:
        out += [f"At {where}.", ""]
    doc = docstring(model)
    if doc:
        out += [doc, ""]
    out += [
        "| field | type | default | constraints | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, field in model.model_fields.items():
        out.append(
            f"| `{name}` | {cell(type_name(field.annotation))} | {default_of(field)} "
            f"| {constraints_of(field)} | {cell(field.description or '')} |"
        )
    return [*out, ""]


def spec_reference() -> str:
    """The generated part of spec.md: the job spec's models, then the sweep's."""
    from service.specs import schemas

    out = [
        "## Reference",
        "",
        "Generated from the pydantic models in `service/specs/schemas/` when the site is built.",
        "",
    ]
    shown: set[type[BaseModel]] = set()
    for model, paths in models_in_order(schemas.JobSpec):
        shown.add(model)
        out += model_table(model, paths)
    sweep = getattr(schemas, "SweepSpec", None)
    if sweep is not None:
        out += ["## Sweeps", "", "The body of `POST /v1/sweeps`.", ""]
        for model, paths in models_in_order(sweep):
            if model not in shown:
                shown.add(model)
                out += model_table(model, paths)
    return "\n".join(out)


def openapi_document() -> dict[str, Any]:
    """The document the API serves at /openapi.json, from an app over an empty database."""
    from service.api.app import create_app
    from service.database.db import Database
    from service.settings import Settings

    with tempfile.TemporaryDirectory() as home:
        db = Database.connect(f"sqlite:///{home}/openapi.db")
        try:
            app = create_app(Settings(home=Path(home)), db)
            return app.openapi()
        finally:
            db.dispose()


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri != SPEC_PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{SPEC_PAGE} lost its marker {MARKER}")
    return markdown.replace(MARKER, spec_reference())


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    content = json.dumps(openapi_document(), indent=1) + "\n"
    files.append(File.generated(config, OPENAPI_FILE, content=content))
    return files
