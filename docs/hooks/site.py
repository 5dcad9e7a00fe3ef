"""MkDocs hook: the site in two languages, and the notebooks' pictures without a kernel.

- Every page opens with a language switch to its counterpart (`X.md` <-> `zh/X.md`,
  `notebooks/X.ipynb` <-> `notebooks/zh/X.ipynb`; a page with none links the other side's home
  page), named for the page it leads to. Chinese pages are marked `lang="zh"`.
- A notebook page is titled by its notebook's first heading ("07 · Preemption"), not its file name.
- A widget view (the steppers of `minivllm.viz.widgets`) needs a kernel; here it becomes the PNG its
  own output carries (the stepper's saved frame) with a note saying where it steps, or, where the
  output carries key frames (`FRAMES_MIME`), a stepper over those frames that works without a
  kernel (overrides/site.js; the saved frame shows until the script runs). The widget state and
  the scripts that would load a widget manager from a CDN are dropped: no page needs the
  network. A widget output without a PNG fails the strict build.
- A notebook's display formula (`$$...$$`) becomes MathML at build time, which the browser draws
  itself: no MathJax from a CDN.
- Inline code breaks only between an identifier's parts (after `.`, `/`, `_`), never mid-word.
- A link named by a file (`[benchmarks.md](benchmarks.md#x)`, right on GitHub) is named on the
  site by the page it opens, and its section: "Benchmarks: Tensor parallelism".
"""

from __future__ import annotations

import html as html_lib
import json
import logging
import posixpath
import re
from pathlib import PurePosixPath

from latex2mathml.converter import convert as tex_to_mathml
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.site")

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FRAMES_MIME = "application/vnd.minivllm.frames+json"  # minivllm.viz.widgets.FRAMES_MIME
_WIDGET_DIV = re.compile(
    r'<div class="jupyter-widgets jp-OutputArea-output[^"]*"[^>]*>\s*'
    r'(?:<script type="text/javascript">[^<]*</script>\s*)?'
    r'<script type="application/vnd\.jupyter\.widget-view\+json">\s*(\{.*?\})\s*</script>\s*</div>', re.S)
_WIDGET_STATE = re.compile(r'<script type="application/vnd\.jupyter\.widget-state\+json">.*?</script>', re.S)
# Scripts from the network: require.js, nbconvert's loader of the widget manager (unpkg), and its
# empty MathJax tag.
_REMOTE_SCRIPT = re.compile(r'<script src="(?:https?:)?//[^"]*"></script>|<script src=""></script>'
                            r'|<script>\s*\(function\(\) \{\s*function addWidgetsRenderer\(\).*?</script>', re.S)
_STEPPER_TEXT = re.compile(r"<stepper over (\d+) frames, showing frame (\d+)>")
_INLINE_CODE = re.compile(r"<code>([^<]{16,})</code>")
_DISPLAY_MATH = re.compile(r"<p>\$\$(.+?)\$\$</p>", re.S)
_ARTICLE = '<article class="md-content__inner md-typeset">'
_LINK = re.compile(r'<a href="([^"#:]*)(#[^"]*)?"( [^>]*)?>((?:<code>)?[\w./<>-]*?(?:</code>)?)</a>')
_FILE_NAME = re.compile(r"^[\w./-]*(?:\.md|\.ipynb|\d\d_[a-z_]+)$")

_files = None  # every page, for the switch's counterpart and its title (set once all are read)


def is_zh(src_uri: str) -> bool:
    return src_uri.startswith(("zh/", "notebooks/zh/"))


def counterpart(src_uri: str) -> str:
    """The other language's version of a page (its source path), whether or not it exists."""
    path = PurePosixPath(src_uri)
    if src_uri.startswith("notebooks/zh/"):
        return f"notebooks/{path.name}"
    if src_uri.startswith("notebooks/"):
        return f"notebooks/zh/{path.name}"
    if src_uri.startswith("zh/"):
        return src_uri[len("zh/"):]
    return f"zh/{src_uri}"


def notebook_title(notebook: dict) -> str | None:
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            heading = re.search(r"^# +(.+?)\s*$", source, re.M)
            if heading:
                return heading.group(1)
    return None


def _widget_outputs(notebook: dict) -> dict[str, dict]:
    """model_id -> the output's mime bundle, for every widget view the notebook saved."""
    found = {}
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                found[data[WIDGET_VIEW]["model_id"]] = data
    return found


def _joined(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def static_widget(data: dict, zh: bool, notebook_name: str) -> str:
    """The saved frame of a widget output as an image, with a note on where it steps."""
    png = _joined(data["image/png"]).replace("\n", "")
    stepper = _STEPPER_TEXT.search(_joined(data.get("text/plain", "")))
    if stepper:
        frames, shown = int(stepper.group(1)), int(stepper.group(2))
        note = (f"步进器保存的画面：第 {shown} 帧（0–{frames - 1}）。逐帧播放需要内核：在 Jupyter 中打开 "
                f'<a download href="{notebook_name}">{notebook_name}</a>。') if zh else (
                f"The stepper's saved frame: step {shown} of 0–{frames - 1}. Stepping needs a kernel: open "
                f'<a download href="{notebook_name}">{notebook_name}</a> in Jupyter.')
        alt = f"frame {shown} of {frames}"
    else:
        note = "交互控件需要内核，这里是它保存的画面。" if zh else "The widget needs a kernel; this is its saved picture."
        alt = "saved widget picture"
    return (f'<div class="jp-OutputArea-output jp-RenderedImage mv-widget-twin">'
            f'<img src="data:image/png;base64,{png}" alt="{alt}">'
            f'<p class="mv-widget-note">{note}</p></div>')


def key_frame_stepper(frames: dict, zh: bool, notebook_name: str) -> str:
    """A stepper over the key frames an output saved: a range input and two buttons (shown by
    overrides/site.js), one picture visible at a time, the saved frame first."""
    shown = next((k for k, f in enumerate(frames["frames"]) if f["index"] == frames["shown"]), 0)
    images = "".join(
        f'<img src="data:image/png;base64,{f["png"]}" alt="frame {f["index"]}" '
        f'data-label="{html_lib.escape(f["label"])}"{"" if k == shown else " hidden"}>'
        for k, f in enumerate(frames["frames"]))
    label = html_lib.escape(frames["frames"][shown]["label"])
    count, total = len(frames["frames"]), frames["count"]
    link = f'<a download href="{notebook_name}">{notebook_name}</a>'
    note = (f"这里可以翻看 {total} 帧中的 {count} 个关键帧；逐帧播放全部画面需要内核：在 Jupyter 中打开 {link}。" if zh
            else f"{count} key frames of {total} here; every frame steps in Jupyter: open {link}.")
    return (f'<div class="jp-OutputArea-output jp-RenderedImage mv-widget-twin mv-stepper">'
            f'<div class="mv-stepper-controls" hidden><button type="button" data-step="-1" aria-label="previous">◀</button>'
            f'<input type="range" min="0" max="{count - 1}" value="{shown}" aria-label="key frame">'
            f'<button type="button" data-step="1" aria-label="next">▶</button>'
            f'<span class="mv-stepper-label">{label}</span></div>'
            f'{images}<p class="mv-widget-note">{note}</p></div>')


def _break_identifiers(output: str) -> str:
    """`<wbr>` after `.`, `/` and `_` in inline code: a long identifier wraps between its parts."""
    def add(match: re.Match) -> str:
        # not before a file's extension: `cache_engine.py` wraps as `cache_` / `engine.py`
        return "<code>" + re.sub(r"(?<=[./_])(?=[^\s./_])(?!(?:py|md|ipynb|json|yml)\b)", "<wbr>",
                                 match.group(1)) + "</code>"
    return _INLINE_CODE.sub(add, output)


def display_math(tex: str) -> str:
    """A display formula as MathML (`\\_` inside `\\text{}` is a plain underscore there)."""
    mathml = tex_to_mathml(html_lib.unescape(tex).strip(), display="block").replace("\\_", "_")
    return f'<div class="mv-math">{mathml}</div>'


def on_page_content(content: str, page, config, files) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return _break_identifiers(content)
    with open(page.file.abs_src_path, encoding="utf-8") as f:
        notebook = json.load(f)
    page.title = notebook_title(notebook) or page.title
    outputs = _widget_outputs(notebook)
    zh, name = is_zh(page.file.src_uri), PurePosixPath(page.file.src_uri).name

    def replace(match: re.Match) -> str:
        data = outputs.get(json.loads(match.group(1))["model_id"])
        if data is None or "image/png" not in data:
            log.warning("%s: a widget output without a saved PNG shows nothing on the site", page.file.src_uri)
            return match.group(0)
        if FRAMES_MIME in data:
            return key_frame_stepper(data[FRAMES_MIME], zh, name)
        return static_widget(data, zh, name)

    content = _WIDGET_DIV.sub(replace, content)
    content = _DISPLAY_MATH.sub(lambda m: display_math(m.group(1)), content)
    content = _REMOTE_SCRIPT.sub("", _WIDGET_STATE.sub("", content))
    return _break_identifiers(content)


def on_env(env, config, files):
    global _files
    _files = files
    return env


def lang_switch(page, files) -> str:
    """The switch's HTML: a link to the counterpart (or the other side's home page), by title."""
    src = page.file.src_uri
    zh = is_zh(src)
    target = files.get_file_from_path(counterpart(src)) or files.get_file_from_path("index.md" if zh else "zh/index.md")
    title = html_lib.escape(target.page.title or "") if target.page else ""
    href = get_relative_url(target.url, page.url)
    lang, label = ("en", "English") if zh else ("zh", "中文")
    return (f'<nav class="mv-lang-switch" aria-label="{label}"><a href="{href}" hreflang="{lang}" lang="{lang}" '
            f'data-counterpart="{target.src_uri}">{label} · {title}</a></nav>')


def _headings(toc) -> dict[str, str]:
    found = {}
    for item in toc:
        found[item.id] = item.title
        found.update(_headings(item.children))
    return found


def name_file_links(output: str, page, files) -> str:
    """Links whose text is a file name get the title of the page they open (and its section)."""
    pages = {f.url: f.page for f in files.documentation_pages() if f.page is not None}

    def rename(match: re.Match) -> str:
        href, anchor, attrs, text = match.group(1), match.group(2) or "", match.group(3) or "", match.group(4)
        if not _FILE_NAME.match(re.sub(r"</?code>|<wbr>", "", text)):
            return match.group(0)
        url = posixpath.normpath(posixpath.join("/" + page.url, href)).lstrip("/")
        target = pages.get(url + "/" if url else "")
        if target is None or not target.title:
            return match.group(0)
        section = _headings(target.toc).get(anchor[1:]) if anchor else None
        name = html_lib.escape(target.title) + (f": {section}" if section else "")
        return f'<a href="{href}{anchor}"{attrs}>{name}</a>'

    return _LINK.sub(rename, output)


def on_post_page(output: str, page, config) -> str:
    if _files is not None and _ARTICLE in output:
        output = output.replace(_ARTICLE, _ARTICLE + lang_switch(page, _files), 1)
        head, article = output.split(_ARTICLE, 1)
        output = head + _ARTICLE + name_file_links(article, page, _files)
    if is_zh(page.file.src_uri):
        output = output.replace('<html lang="en"', '<html lang="zh"', 1)
    return output
