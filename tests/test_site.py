"""The course site builds in strict mode and renders in a real headless browser.

`mkdocs build --strict` (docs/ and the notebooks with their committed outputs; nothing is
executed), then Debian's chromium loads pages from a local HTTP server: the text is there, every
image (the notebooks' figures are inline PNGs) decoded, the Chinese pages are present. CI
installs chromium (.ci/run); without it this test fails, it never skips.
"""

from __future__ import annotations

import functools
import http.server
import json
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
                  "--virtual-time-budget=15000", "--dump-dom"]
# Marks, after the load event, how many images the page has and which ones did not decode.
IMAGE_PROBE = """<script>
window.addEventListener("load", () => {
  const broken = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80));
  document.documentElement.setAttribute("data-images", String(document.images.length));
  document.documentElement.setAttribute("data-broken-images", JSON.stringify(broken));
});
</script>"""
PAGES = {
    "index.html": ["minivllm", "中文首页", "download.pytorch.org/whl/cpu"],
    "usage/index.html": ["Using minivllm", "download.pytorch.org/whl/cpu", "How generation ends"],
    "modules/index.html": ["Who calls whom", "Common misconceptions", "The preemption victim is the back"],
    "learning-path/index.html": ["read next in vLLM", "block_manager_v1.py"],
    "exercises/index.html": ["check_slot_mapping"],
    "notebooks/00_tour/index.html": ["A tour of minivllm", "Exercise 00.1"],
    "notebooks/02_blocks_and_block_tables/index.html": ["Blocks and block tables", "slot_mapping"],
    "notebooks/14_engine_end_to_end/index.html": ["The engine, end to end"],
    "zh/index.html": ["教学用参考实现", "download.pytorch.org/whl/cpu"],
    "zh/usage/index.html": ["使用指南", "生成何时结束"],
    "zh/learning-path/index.html": ["接下来读 vLLM"],
    "zh/interview/index.html": ["面试标准答案", "写时复制"],
    "zh/glossary/index.html": ["槽位映射", "连续批处理", "投机解码"],
    "zh/modules/index.html": ["被抢占的是运行队列的尾部"],
}
MIN_IMAGES = {"modules/index.html": 1, "notebooks/00_tour/index.html": 2,
              "notebooks/02_blocks_and_block_tables/index.html": 3, "notebooks/14_engine_end_to_end/index.html": 3}


@pytest.fixture(scope="module")
def site():
    out = Path(tempfile.mkdtemp(prefix="minivllm-site-"))
    result = subprocess.run(["mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for page in PAGES:  # the probe goes into this test's copy only, never into the docs
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


def test_every_notebook_and_zh_page_is_built(site):
    out, _ = site
    for notebook in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        assert (out / "notebooks" / notebook.stem / "index.html").exists(), notebook.name
    assert len(list((out / "zh").glob("*/index.html"))) >= 4


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_renders_in_a_browser(site, page):
    _, base = site
    dom = _dump_dom(base + page)
    text = re.sub(r"<[^>]+>", " ", dom)
    for needle in PAGES[page]:
        assert needle in text, f"{page}: {needle!r} not rendered"
    images = re.search(r'data-images="(\d+)"', dom)
    broken = re.search(r'data-broken-images="([^"]*)"', dom)
    assert images and broken, f"{page}: the load event never fired"
    assert json.loads(broken.group(1).replace("&quot;", '"')) == [], f"{page}: images that did not load"
    assert int(images.group(1)) >= MIN_IMAGES.get(page, 0), f"{page}: {images.group(1)} images"
