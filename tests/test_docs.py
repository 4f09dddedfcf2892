"""The README and docs/*.md: every relative link and anchor resolves, and the README stays
a user's page (short, the two commands, every server flag and request field)."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but ``-``
    and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    anchors: set[str] = set()
    count: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = count.get(slug, 0)
            count[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page: pathlib.Path) -> None:
    bad = []
    for url in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:
            continue
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{url}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{url}: no such heading")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


def test_readme_is_a_users_page() -> None:
    """Under 250 lines (measurements and history live in docs/), the two commands as
    CI and the scripts name them, and every server flag and request field."""
    from nexus_vllm.integration.config import REQUEST_FIELDS
    from nexus_vllm.integration.frontend.server_config import SERVER_FLAGS

    text = README.read_text()
    assert len(text.splitlines()) < 250
    assert "\nbash scripts/serve.sh " in text and "\nbash scripts/test.sh " in text
    missing = [f for f in (*SERVER_FLAGS, *REQUEST_FIELDS) if f"`{f}" not in text]
    assert not missing, f"README lacks {missing}"
