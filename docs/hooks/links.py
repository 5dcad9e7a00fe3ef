"""MkDocs hook: the docs link to notebooks as `../notebooks/X.ipynb` (right on GitHub); on the
site the notebooks are `docs/notebooks/` (a symlink to the repository's `notebooks/`), so those
links are rewritten to stay inside the site (a Chinese twin: `../notebooks/zh/X.ipynb`; a lab:
`../notebooks/labs/X.ipynb` or the capstone's `.md`). A notebook not in the tree (yet) becomes
plain text instead of a broken link."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

_NOTEBOOK_LINK = re.compile(r"\[([^\]]*)\]\((?:\.\./)+notebooks/((?:zh/|labs/)?[\w.-]+\.(?:ipynb|md))(#[^)]*)?\)")
_NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def on_page_markdown(markdown: str, page, config, files) -> str:
    depth = page.file.src_uri.count("/")  # 0 for docs/x.md, 1 for docs/zh/x.md

    def rewrite(match: re.Match) -> str:
        text, name, anchor = match.group(1), match.group(2), match.group(3) or ""
        if not (_NOTEBOOKS / name).exists():
            return f"{text} (notebook not in the tree yet)"
        return f"[{text}]({'../' * depth}notebooks/{name}{anchor})"

    return _NOTEBOOK_LINK.sub(rewrite, markdown)


# Notebooks link to the docs as `../docs/X.md` (right on GitHub and in Jupyter; the Chinese twins
# in notebooks/zh/ as `../../docs/X.md`); on the site a notebook is the page notebooks/<name>/
# (or notebooks/zh/<name>/), and a doc page X.md is X/.
_DOCS_LINK = re.compile(r'href="(?:\.\./)+docs/([\w/.-]+?)\.md(#[^"]*)?"')
# Notebooks link to each other by file (`zh/02_x.ipynb`, `../02_x.ipynb`); on the site a notebook
# is a page. A `download` link is the notebook file itself, copied beside its page.
_NOTEBOOK_HREF = re.compile(r'(?<!download )href="((?:\.\./|zh/)*[\w.-]+\.ipynb)(#[^"]*)?"')


def on_post_page(output: str, page, config) -> str:
    if not page.file.src_uri.startswith("notebooks/"):
        return output
    up = "../" * (page.file.src_uri.count("/") + 1)  # notebooks/X.ipynb -> notebooks/X/ -> root
    output = _DOCS_LINK.sub(lambda m: f'href="{up}{m.group(1)}/{m.group(2) or ""}"', output)

    def notebook_page(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), match.group(1)))
        if not target.startswith("notebooks/"):
            return match.group(0)
        return f'href="{up}{target[:-len(".ipynb")]}/{match.group(2) or ""}"'

    return _NOTEBOOK_HREF.sub(notebook_page, output)
