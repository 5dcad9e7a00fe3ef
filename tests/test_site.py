"""The course site builds in strict mode and renders in a real headless browser.

`mkdocs build --strict` (docs/ and the notebooks with their committed outputs; nothing is
executed), then Debian's chromium loads pages from a local HTTP server, offline (every host but
127.0.0.1 unresolvable): the text is there, every image (the notebooks' figures are inline PNGs)
decoded, the Chinese pages are present, each stepper shows its saved frame, and every page's
language switch leads to its counterpart and back. CI installs chromium (.ci/run); without it
this test fails, it never skips.
"""

from __future__ import annotations

import functools
import importlib.util
import html
import http.server
import json
import posixpath
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",  # offline: no CDN
                  "--window-size=1440,900", "--virtual-time-budget=15000", "--dump-dom"]
# Marks, after the load event, how many images the page has and which ones did not decode.
IMAGE_PROBE = """<script>
window.addEventListener("load", () => {
  const broken = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80));
  document.documentElement.setAttribute("data-images", String(document.images.length));
  document.documentElement.setAttribute("data-broken-images", JSON.stringify(broken));
  const link = document.querySelector("nav.mv-lang-switch a");
  const frames = [...document.querySelectorAll(".mv-widget-twin img")].filter(i => !i.hidden);
  document.documentElement.setAttribute("data-site", JSON.stringify({
    lang: document.documentElement.lang,
    switch: link && [new URL(link.href).pathname, link.textContent, link.hreflang],
    // a widget view nobody rendered is an empty box; a saved frame is a decoded, visible picture
    widgets: [...document.querySelectorAll(".jupyter-widgets")].length,
    frames: frames.map(i => [i.naturalWidth, Math.round(i.getBoundingClientRect().width)]),
    notes: [...document.querySelectorAll(".mv-widget-note")].map(n => n.textContent),
    figures: [...document.querySelectorAll(".jp-RenderedImage img")].filter(i => !i.hidden)
      .map(i => [i.naturalWidth, Math.round(i.getBoundingClientRect().width)]),
    remote: [...document.scripts].filter(s => s.src && new URL(s.src).origin !== location.origin).map(s => s.src),
  }));
});
</script>"""
PAGES = {
    "index.html": ["minivllm", "中文首页", "download.pytorch.org/whl/cpu"],
    "usage/index.html": ["Using minivllm", "download.pytorch.org/whl/cpu", "How generation ends"],
    "modules/index.html": ["Who calls whom", "Common misconceptions", "The preemption victim is the back"],
    "learning-path/index.html": ["read next in vLLM", "block_manager_v1.py"],
    "exercises/index.html": ["check_slot_owner"],
    "notebooks/00_tour/index.html": ["A tour of minivllm", "Exercise 00.1"],
    "notebooks/02_blocks_and_block_tables/index.html": ["Blocks and block tables", "slot_mapping"],
    "notebooks/14_engine_end_to_end/index.html": ["The engine, end to end"],
    "zh/index.html": ["教学用参考实现", "download.pytorch.org/whl/cpu"],
    "zh/usage/index.html": ["使用指南", "生成何时结束"],
    "zh/learning-path/index.html": ["接下来读 vLLM"],
    "zh/interview/index.html": ["面试标准答案", "写时复制"],
    "zh/glossary/index.html": ["槽位映射", "连续批处理", "投机解码"],
    "zh/modules/index.html": ["被抢占的是运行队列的尾部"],
    "notebooks/07_preemption/index.html": ["07 · Preemption", "Who is preempted"],
    "notebooks/zh/07_preemption/index.html": ["07 ·", "English · 07 · Preemption"],
    "notebooks/zh/02_blocks_and_block_tables/index.html": ["02 ·", "English · 02 · Blocks and block tables"],
}
# Page -> (its counterpart's page, words of the counterpart's title the switch shows); a page with
# no counterpart leads to the other side's home page.
SWITCH = {
    "index.html": ("zh/", "首页"),
    "usage/index.html": ("zh/usage/", "使用指南"),
    "exercises/index.html": ("zh/", "首页"),
    "notebooks/02_blocks_and_block_tables/index.html": ("notebooks/zh/02_blocks_and_block_tables/", "02 ·"),
    "notebooks/07_preemption/index.html": ("notebooks/zh/07_preemption/", "07 ·"),
    "zh/index.html": ("", "Home"),
    "interview/index.html": ("zh/interview/", "面试"),
    "zh/interview/index.html": ("interview/", "Interview"),
    "zh/glossary/index.html": ("", "Home"),
    "notebooks/zh/07_preemption/index.html": ("notebooks/07_preemption/", "07 · Preemption"),
    "notebooks/zh/02_blocks_and_block_tables/index.html": ("notebooks/02_blocks_and_block_tables/", "02 · Blocks"),
}
# Notebooks whose stepper (a widget) the site shows as its saved frame.
STEPPERS = ["notebooks/07_preemption/index.html", "notebooks/zh/07_preemption/index.html",
            "notebooks/zh/02_blocks_and_block_tables/index.html"]
MIN_IMAGES = {"modules/index.html": 1, "notebooks/00_tour/index.html": 2,
              "notebooks/02_blocks_and_block_tables/index.html": 3, "notebooks/14_engine_end_to_end/index.html": 3}


@pytest.fixture(scope="module")
def site():
    out = Path(tempfile.mkdtemp(prefix="minivllm-site-"))
    result = subprocess.run(["mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for page in set(PAGES) | set(SWITCH):  # the probe goes into this test's copy only, never into the docs
        path = out / page
        path.write_text(path.read_text(encoding="utf-8").replace("</body>", IMAGE_PROBE + "</body>"), encoding="utf-8")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    shutil.rmtree(out, ignore_errors=True)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is needed for the site check (apt-get install -y chromium; .ci/run does it)"
    return path


@functools.lru_cache(maxsize=None)  # a page is loaded once however many tests read it
def _dump_dom(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        result = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_notebook_links_to_the_docs_stay_on_the_site(site):
    out, _ = site
    html = (out / "notebooks/00_tour/index.html").read_text(encoding="utf-8")
    assert 'href="../../modules/"' in html and 'href="../../zh/modules/"' in html
    assert 'href="../docs/' not in html
    twin = (out / "notebooks/zh/07_preemption/index.html").read_text(encoding="utf-8")
    assert '<a href="../../../notebooks/07_preemption/">English</a>' in twin  # a notebook's link to a notebook
    assert 'href="../07_preemption.ipynb"' not in twin


def test_every_notebook_and_zh_page_is_built(site):
    out, _ = site
    for notebook in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        assert (out / "notebooks" / notebook.stem / "index.html").exists(), notebook.name
    assert len(list((out / "zh").glob("*/index.html"))) >= 4


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_renders_in_a_browser(site, page):
    _, base = site
    dom = _dump_dom(base + page)
    text = re.sub(r"<[^>]+>", " ", dom.replace("<wbr>", ""))  # <wbr>: a break point inside a word
    for needle in PAGES[page]:
        assert needle in text, f"{page}: {needle!r} not rendered"
    images = re.search(r'data-images="(\d+)"', dom)
    broken = re.search(r'data-broken-images="([^"]*)"', dom)
    assert images and broken, f"{page}: the load event never fired"
    assert json.loads(broken.group(1).replace("&quot;", '"')) == [], f"{page}: images that did not load"
    assert int(images.group(1)) >= MIN_IMAGES.get(page, 0), f"{page}: {images.group(1)} images"


def _probe(site, page: str) -> dict:
    _, base = site
    found = re.search(r'data-site="([^"]*)"', _dump_dom(base + page))
    assert found, f"{page}: the load event never fired"
    return json.loads(html.unescape(found.group(1)))


def _built_pages(out: Path) -> dict[str, str]:
    """Site path of every page ("" for the home page, "zh/usage/") -> its HTML."""
    pages = {}
    for path in out.rglob("index.html"):
        where = path.parent.relative_to(out).as_posix()
        if "assets" not in path.parts:
            pages["" if where == "." else where + "/"] = path.read_text(encoding="utf-8")
    return pages


def test_every_page_switches_to_its_counterpart_and_back(site):
    out, _ = site
    pages = _built_pages(out)
    targets = {}
    for path, page_html in pages.items():
        links = re.findall(r'<nav class="mv-lang-switch"[^>]*><a href="([^"]*)"', page_html)
        assert len(links) == 1, f"{path or 'home'}: {len(links)} language switches"
        target = posixpath.normpath(posixpath.join("/" + path, links[0])).lstrip("/")
        targets[path] = target + "/" if target else ""
    for path, target in targets.items():
        assert target in pages, f"{path}: the switch leads to a missing page {target}"
        zh = path.startswith(("zh/", "notebooks/zh/"))
        assert target.startswith(("zh/", "notebooks/zh/")) != zh, f"{path}: the switch stays in its language"
        # A counterpart leads back; a page without one leads to the other side's home page.
        assert targets[target] == path or target == ("" if zh else "zh/"), f"{path} -> {target} -> {targets[target]}"
    for notebook in (ROOT / "notebooks" / "zh").glob("[0-9]*.ipynb"):  # every twin is paired
        assert targets[f"notebooks/zh/{notebook.stem}/"] == f"notebooks/{notebook.stem}/"


@pytest.mark.parametrize("page", sorted(SWITCH))
def test_language_switch_in_a_browser(site, page):
    probe = _probe(site, page)
    target, words = SWITCH[page]
    assert probe["switch"], f"{page}: no language switch"
    path, text, hreflang = probe["switch"]
    zh = page.startswith(("zh/", "notebooks/zh/"))
    assert path == "/" + target and words in text, probe["switch"]
    assert (probe["lang"], hreflang) == (("zh", "en") if zh else ("en", "zh"))
    assert not re.search(r"\d\d_\w+", text), f"{page}: the switch names a file, not a page: {text}"


@pytest.mark.parametrize("page, labels", [
    ("zh/index.html", ('placeholder="搜索"', "目录", "回到页面顶部")),
    ("notebooks/zh/07_preemption/index.html", ('placeholder="搜索"', "目录")),
    ("index.html", ('placeholder="Search"', "Table of contents", "Back to top")),
])
def test_the_themes_labels_speak_the_pages_language(site, page, labels):
    out, _ = site
    html = (out / page).read_text(encoding="utf-8")
    missing = [label for label in labels if label not in html]
    assert not missing, f"{page}: labels not in the page's language: {missing}"


def test_nav_names_notebooks_by_title(site):
    out, _ = site
    page_html = (out / "notebooks/07_preemption/index.html").read_text(encoding="utf-8")
    nav = re.sub(r"<[^>]+>", " ", page_html[page_html.index("md-nav--primary"):page_html.index('<div class="md-content"')])
    nav = " ".join(nav.split())
    assert "00 · A tour of minivllm" in nav and "07 · Preemption" in nav
    assert "00 tour" not in nav and "07 preemption" not in nav
    zh_html = (out / "notebooks/zh/07_preemption/index.html").read_text(encoding="utf-8")
    assert '<html lang="zh"' in zh_html and "课程 notebook" in zh_html


def test_no_page_loads_a_script_from_the_network_and_no_widget_is_left_blank(site):
    out, _ = site
    for path, page_html in _built_pages(out).items():
        assert not re.search(r'<script src="(https?:)?//', page_html), path
        for dead in ("widget-view+json", "widget-state+json", "unpkg.com", "require.min.js"):
            assert dead not in page_html, f"{path}: {dead}"
    for notebook in sorted((ROOT / "notebooks").glob("**/[0-9]*.ipynb")):
        if ".ipynb_checkpoints" in notebook.parts:
            continue
        views = notebook.read_text(encoding="utf-8").count('"application/vnd.jupyter.widget-view+json"')
        built = (out / notebook.relative_to(ROOT).with_suffix("") / "index.html").read_text(encoding="utf-8")
        assert len(re.findall(r'class="jp-OutputArea-output jp-RenderedImage mv-widget-twin[" ]', built)) == views, notebook.name


@pytest.mark.parametrize("page", STEPPERS)
def test_stepper_shows_its_saved_frame_offline(site, page):
    probe = _probe(site, page)
    assert probe["remote"] == [], f"{page}: scripts from the network {probe['remote']}"
    assert probe["widgets"] == 0, f"{page}: a widget box waits for a widget manager (blank offline)"
    assert len(probe["frames"]) == 1 and len(probe["notes"]) == 1, probe
    natural, shown = probe["frames"][0]
    assert natural > 0 and shown >= 0.75 * natural, f"{page}: frame {natural} px shown at {shown} px"
    step = "帧" if "/zh/" in f"/{page}" else "step"
    assert step in probe["notes"][0] and ".ipynb" in probe["notes"][0], probe["notes"]


def test_formulas_are_mathml_not_raw_tex(site):
    out, _ = site
    for notebook in sorted((ROOT / "notebooks").glob("**/[0-9]*.ipynb")):
        if ".ipynb_checkpoints" in notebook.parts:
            continue
        formulas = sum("".join(cell["source"]).count("$$") // 2 for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]
                       if cell["cell_type"] == "markdown")
        built = (out / notebook.relative_to(ROOT).with_suffix("") / "index.html").read_text(encoding="utf-8")
        assert built.count('<div class="mv-math"><math') == formulas and "<p>$$" not in built, notebook.name
    slot = (out / "notebooks/02_blocks_and_block_tables/index.html").read_text(encoding="utf-8")
    assert "<mtext>block_table</mtext>" in slot  # \_ inside \text{} is a plain underscore


def test_glossary_identifiers_break_between_their_parts(site):
    out, _ = site
    glossary = (out / "zh/glossary/index.html").read_text(encoding="utf-8")
    assert "<code>BlockSpaceManager.<wbr>get_<wbr>block_<wbr>table</code>" in glossary
    assert "<code>core/<wbr>block_<wbr>manager.py</code>" in glossary  # never before an extension
    css = (ROOT / "docs/overrides/site.css").read_text(encoding="utf-8")
    assert re.search(r"\.md-typeset code \{ word-break: keep-all; overflow-wrap: normal; \}", css)


def _load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_key_frames_step_without_a_kernel(site):
    """A stepper output that saved key frames becomes a stepper that works on the site: the saved
    frame first, the next button shows the next key frame and its label."""
    import matplotlib

    matplotlib.use("Agg")
    from minivllm.viz.widgets import FrameStepper

    out, base = site
    stepper = FrameStepper(list(range(40)), lambda n, ax: ax.bar(range(n % 5 + 1), 1), figsize=(2, 1),
                           marks={3: "first swap-out", 30: "first swap-in"})
    stepper.slider.value = 3
    bundle = stepper._repr_mimebundle_()
    frames = bundle[_load_hook("site").FRAMES_MIME]
    assert [f["index"] for f in frames["frames"]] == [3, 30] and frames["shown"] == 3
    page = out / "stepper-check" / "index.html"
    page.parent.mkdir()
    page.write_text(
        '<html><head><link rel="stylesheet" href="../overrides/site.css"></head><body class="md-typeset">'
        '<div class="jupyter-wrapper">' + _load_hook("site").key_frame_stepper(frames, False, "x.ipynb") + "</div>"
        '<script src="../overrides/site.js"></script><script>window.addEventListener("load", () => {'
        ' const visible = () => [...document.querySelectorAll(".mv-stepper > img")].filter(i => !i.hidden).map(i => i.alt);'
        ' const label = () => document.querySelector(".mv-stepper-label").textContent;'
        ' const before = [visible(), label(), document.querySelector(".mv-stepper-controls").hidden];'
        ' document.querySelector(\'button[data-step="1"]\').click();'
        ' document.documentElement.setAttribute("data-steps", JSON.stringify([before, [visible(), label()]]));'
        "});</script></body></html>", encoding="utf-8")
    found = re.search(r'data-steps="([^"]*)"', _dump_dom(base + "stepper-check/"))
    assert found, "the load event never fired"
    before, after = json.loads(html.unescape(found.group(1)))
    assert before == [["frame 3"], "first swap-out", False]  # the saved frame, controls shown
    assert after == [["frame 30"], "first swap-in"]


@pytest.mark.parametrize("page", sorted(p for p in set(PAGES) | set(SWITCH) if p.startswith("notebooks/")))
def test_notebook_figures_keep_their_size_on_a_laptop_screen(site, page):
    # At 1440 px the content column holds ~1040 px figures: none is shrunk below two thirds.
    figures = _probe(site, page)["figures"]
    assert figures, f"{page}: no figures"
    assert min(shown / natural for natural, shown in figures) >= 0.65, f"{page}: {figures}"


def test_links_are_named_for_their_pages_not_file_names(site):
    out, _ = site
    file_named = re.compile(r'<a href="[^"]*"[^>]*>(?:<code>)?[\w./-]*(?:\.md|\.ipynb|\d\d_[a-z_]+)(?:</code>)?</a>')
    for path, page_html in _built_pages(out).items():
        article = page_html.split('<article class="md-content__inner md-typeset">', 1)[-1].replace("<wbr>", "")
        assert not file_named.findall(article), f"{path}: {file_named.findall(article)[:3]}"
    zh_interview = (out / "zh/interview/index.html").read_text(encoding="utf-8")
    assert '<a href="../../benchmarks/#tensor-parallelism">Benchmarks: Tensor parallelism</a>' in zh_interview


def test_a_widget_without_a_saved_frame_fails_the_build(tmp_path, caplog):
    """The hook warns (strict mode turns it into a failed build) rather than leave a blank box."""
    from types import SimpleNamespace

    view = {"model_id": "m1", "version_major": 2, "version_minor": 0}
    notebook = {"cells": [{"cell_type": "markdown", "source": "# 99 · Title"},
                          {"cell_type": "code", "source": "w", "outputs": [{"output_type": "display_data", "data": {
                              "application/vnd.jupyter.widget-view+json": view, "text/plain": "VBox()"}}]}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(notebook), encoding="utf-8")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="notebooks/99_x.ipynb", abs_src_path=str(path)), title=None)
    content = ('<div class="jupyter-widgets jp-OutputArea-output" id="x"><script type="application/vnd.jupyter.'
               'widget-view+json">' + json.dumps(view) + "</script></div>")
    with caplog.at_level("WARNING", logger="mkdocs.hooks.site"):
        _load_hook("site").on_page_content(content, page, None, None)
    assert page.title == "99 · Title"
    assert "a widget output without a saved PNG" in caplog.text
