"""The API reference's source covers every public name, and every page is reachable, so a new
public name or page without documentation fails `make test` (`make docs` builds the site)."""

import re
from pathlib import Path

import pytest

import jaxkv
import jaxkv.mx
import jaxkv.nd

DOCS = Path(__file__).resolve().parent.parent / "docs"
API = (DOCS / "api.md").read_text()


def _documented(qualname: str) -> bool:
    pattern = rf"^\.\. auto(function|class|exception|data|module):: {re.escape(qualname)}$"
    return re.search(pattern, API, re.MULTILINE) is not None


@pytest.mark.parametrize("name", jaxkv.__all__)
def test_every_public_name_has_an_entry_in_the_api_reference(name):
    assert _documented(f"jaxkv.{name}") or (
        re.search(r"^\.\. currentmodule:: jaxkv$", API, re.MULTILINE) and _documented(name)
    ), f"docs/api.md: add an autodoc entry for jaxkv.{name}"


@pytest.mark.parametrize("name", jaxkv.nd.__all__)
def test_every_name_of_nd_has_an_entry_in_the_api_reference(name):
    assert _documented(f"jaxkv.nd.{name}"), f"docs/api.md: add an entry for jaxkv.nd.{name}"


@pytest.mark.parametrize("name", jaxkv.mx.__all__)
def test_every_name_of_mx_is_in_the_api_reference_table(name):
    assert f"`mx.{name}" in API, f"docs/api.md: add mx.{name} to the jaxkv.mx table"


def test_the_launcher_options_come_from_its_parser():
    assert re.search(r"^```\{launch-help\}$", API, re.MULTILINE)


def test_every_page_is_in_a_toctree():
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"^([\w-]+)$", index, re.MULTILINE))
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, f"docs/index.md: add {sorted(pages - listed)} to a toctree"
