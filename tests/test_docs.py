"""The docs as a product: every relative link resolves, the references are generated from the
code and match it, the README stays short and shows its pictures."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

from tests.helpers import REPO

README = os.path.join(REPO, "README.md")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
README_MAX_BYTES = 12_288


def _doc_files() -> list[str]:
    return [README] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 for repeated ones."""
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: str) -> list[str]:
    """'file: link (why)' for every relative link of `path` that does not resolve."""
    out = []
    rel = os.path.relpath(path, REPO)
    for m in LINK.finditer(_prose(open(path).read())):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        if not os.path.exists(dest):
            out.append(f"{rel}: {target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            out.append(f"{rel}: {target} (no heading with anchor #{anchor})")
    return out


def test_slug_follows_github():
    assert slug("2b. Own update first (`overlap.dcn_delay_mode: local`)") == \
        "2b-own-update-first-overlapdcn_delay_mode-local"
    assert slug("Train on GPUs") == "train-on-gpus"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# A title\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok](there.md#a-title) [bad](gone.md) "
                   "[bad](there.md#nope) [web](https://x.org/y) `[code](gone.md)`\n")
    assert broken_links(str(doc)) == [
        f"{os.path.relpath(doc, REPO)}: gone.md (no such file)",
        f"{os.path.relpath(doc, REPO)}: there.md#nope (no heading with anchor #nope)"]


def test_every_relative_link_resolves():
    bad = [b for f in _doc_files() for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_is_short():
    size = os.path.getsize(README)
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; keep it <= {README_MAX_BYTES}"


def _gen_reference():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", os.path.join(REPO, "scripts", "gen_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_references_match_the_code():
    gen = _gen_reference()
    stale = gen.stale()
    assert not stale, (f"{', '.join(stale)} differ from the code: run `{gen.COMMAND}` and "
                       f"commit the result")


def test_config_reference_names_every_key():
    from jax_overlap.config import Config
    import dataclasses

    text = open(os.path.join(REPO, "docs", "reference", "config.md")).read()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            row = re.search(rf"^\| `{section.name}\.{f.name}` \|(.*)$", text, flags=re.M)
            assert row, f"{section.name}.{f.name} missing from docs/reference/config.md"
            meaning = row.group(1).rstrip(" |").rsplit("|", 1)[-1].strip()
            assert meaning, f"{section.name}.{f.name}: no meaning; comment the field in config.py"


def test_cli_reference_names_every_flag():
    from jax_overlap.cli import build_parser
    import argparse

    text = open(os.path.join(REPO, "docs", "reference", "cli.md")).read()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, f"{name} {flag} missing from docs/reference/cli.md"


def test_readme_shows_the_pictures():
    """The TensorBoard screenshot and the ZB-V schedule exist as real PNGs and the README
    shows them (`python scripts/make_images.py` redraws both)."""
    readme = open(README).read()
    for name in ("tensorboard.png", "schedule_zbv.png"):
        path = os.path.join(REPO, "docs", "images", name)
        assert os.path.exists(path), f"docs/images/{name} missing: run scripts/make_images.py"
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"docs/images/{name} is not a PNG"
        assert os.path.getsize(path) > 20_000, f"docs/images/{name} is under 20 KB"
        assert f"](docs/images/{name})" in readme, f"README.md does not show docs/images/{name}"
