"""`kvdbg report --html`: one self-contained file, opened in headless Chromium, with the verdict and the pictures.

The screenshot and the file are kept under out/html_report/ as test artefacts.
Chromium is Debian's `chromium` package (.ci/run installs it); without it the
test is skipped on a developer's machine and fails under CI (CI=true), so CI
cannot pass it by skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli

from tests.helpers import FIXTURES, ROOT

ARTEFACTS = os.path.join(ROOT, "out", "html_report")
# Flags that keep a headless Chromium off the network and away from any profile: a fresh
# --user-data-dir per run, and nothing that phones home.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--mute-audio"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("headless Chromium is needed for the HTML report test: apt-get install -y chromium")
        pytest.skip("no chromium on this machine (apt-get install -y chromium)")
    return found


def browse(binary: str, page: str, *extra: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="kvdbg-chromium-") as profile:
        return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra,
                               f"file://{page}"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def html_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    page = out / "report.html"
    res = CliRunner().invoke(cli, ["report", os.path.join(FIXTURES, "prefix_page0.safetensors"), "-o",
                                   str(out / "report.md"), "--html", str(page)])
    assert res.exit_code == 1, res.output  # flex masks page 0: the replay fails
    return page


def test_the_file_is_self_contained(html_report):
    text = html_report.read_text()
    assert text.startswith("<!DOCTYPE html>")
    # Nothing is fetched: no script, stylesheet link, font, image or frame source; the only URL is the SVG namespace.
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b", text, re.I)
    assert "@font-face" not in text and "url(" not in text and "@import" not in text
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) == {"http://www.w3.org/2000/svg"}
    assert 'id="verdict"' in text and "FAIL" in text
    for ident in ("error-map", "error-steps", "attention-picture", "window-picture"):
        assert f'<figure id="{ident}"><svg' in text


def test_chromium_renders_the_verdict_and_the_pictures(html_report):
    binary = chromium()
    os.makedirs(ARTEFACTS, exist_ok=True)
    kept = os.path.join(ARTEFACTS, "report.html")
    shutil.copyfile(html_report, kept)
    dom = browse(binary, kept, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = dom.stdout
    verdict = re.search(r'<p class="verdict fail" id="verdict">(.*?)</p>', rendered, re.S)
    assert verdict and verdict.group(1).startswith("FAIL: 2 of 2 comparison(s) failed (flex vs reference)")
    for ident in ("error-map", "error-steps", "attention-picture", "window-picture"):
        figure = re.search(rf'<figure id="{ident}">(.*?)</figure>', rendered, re.S)
        assert figure and "<svg" in figure.group(1) and "<rect" in figure.group(1), ident
    assert "null block (engine page 0) at keys 32..47" in rendered
    shot = os.path.join(ARTEFACTS, "report.png")
    if os.path.exists(shot):
        os.remove(shot)
    res = browse(binary, kept, f"--screenshot={shot}", "--window-size=1200,2600")
    assert res.returncode == 0 and os.path.getsize(shot) > 10_000, res.stderr[-2000:]
    Image = pytest.importorskip("PIL.Image")  # matplotlib's dependency: present with the plot extra
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2600)
    colours = image.getcolors(maxcolors=1 << 20)
    # The verdict box (#ffebee background) and the failing cells of the error map (#cb181d) were painted.
    painted = {rgb for _, rgb in colours}
    assert (255, 235, 238) in painted
    assert any(abs(r - 203) <= 3 and abs(g - 24) <= 3 and abs(b - 29) <= 3 for r, g, b in painted)
