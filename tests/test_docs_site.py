"""The documentation site builds with ``mkdocs build --strict`` (every link and anchor
resolves, every page is in the nav), its job spec reference is generated from the pydantic
models (so every field of every spec section is on the page), and README.md stays the front
door: short, with every relative link pointing at a file that exists."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import BaseModel

from service.specs import schemas

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(out)},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def sections(page: str) -> dict[str, str]:
    """A built page cut at its headings: heading id -> the HTML up to the next heading."""
    parts = re.split(r'<h[23] id="([^"]+)"', page)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def schema_models() -> dict[str, dict[str, Any]]:
    """Every object model of the job spec and the sweep spec, from their JSON schemas (not
    from the generator's own walk), with its properties."""
    models: dict[str, dict[str, Any]] = {}
    for root in (schemas.JobSpec, schemas.SweepSpec):
        document = root.model_json_schema()
        models[root.__name__] = document["properties"]
        for name, definition in document.get("$defs", {}).items():
            if "properties" in definition:
                models[name] = definition["properties"]
    return models


def test_the_spec_reference_lists_every_field_of_the_job_spec(site: Path) -> None:
    page = html.unescape((site / "spec" / "index.html").read_text())
    found = sections(page)
    assert "jobspec" in found, sorted(found)
    for field in schemas.JobSpec.model_fields:
        assert f"<code>{field}</code>" in found["jobspec"], field


def test_the_spec_reference_has_a_table_for_every_section_model_with_all_its_fields(
    site: Path,
) -> None:
    page = html.unescape((site / "spec" / "index.html").read_text())
    found = sections(page)
    for model, properties in schema_models().items():
        assert model.lower() in found, f"no table for {model}"
        for field in properties:
            assert f"<code>{field}</code>" in found[model.lower()], f"{model}.{field}"


def test_the_spec_reference_shows_defaults_and_bounds_from_the_models(site: Path) -> None:
    page = html.unescape((site / "spec" / "index.html").read_text())
    scale = sections(page)["lossscalespec"]
    default = schemas.LossScaleSpec.model_fields["growth_steps"].default
    row = next(r for r in scale.split("<tr>") if "<code>growth_steps</code>" in r)
    assert f"<code>{default}</code>" in row and "≥ 1" in row, row


def test_the_site_carries_the_openapi_document_the_app_serves(
    site: Path, client: TestClient
) -> None:
    document = json.loads((site / "openapi.json").read_text())
    assert "/v1/jobs" in document["paths"]
    assert document == client.get("/openapi.json").json()


def nav_files(entries: Any) -> list[str]:
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [f for e in entries for f in nav_files(e)]
    if isinstance(entries, dict):
        return [f for v in entries.values() for f in nav_files(v)]
    return []


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = set(nav_files(config["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), "pages missing from mkdocs.yml's nav"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < 260, len(lines)


def relative_links(markdown: Path) -> list[str]:
    text = FENCE.sub("", markdown.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


GENERATED = {"openapi.json"}  # written into the site by docs/hooks/halfway_docs.py


@pytest.mark.parametrize(
    "markdown",
    [README, *sorted(DOCS.rglob("*.md"))],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_every_relative_link_points_at_a_file_that_exists(markdown: Path) -> None:
    missing = [
        target
        for target in relative_links(markdown)
        if not (markdown.parent / target).exists()
        and not (markdown.parent == DOCS and target in GENERATED)
    ]
    assert missing == [], missing


def test_the_readme_links_every_docs_page() -> None:
    linked = {Path(t).name for t in relative_links(README) if t.startswith("docs/")}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - linked == set()


def test_models_reachable_from_the_spec_are_pydantic_models() -> None:
    # A guard for the generator's walk: the spec's sections are models, not bare dicts.
    for name in ("precision", "loss_scale", "training", "optimizer"):
        annotation = schemas.JobSpec.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), name
