"""`kvdbg window --picture/--svg/--png`: the query x key grids, checked against known answers and the backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import get_backend
from kvdbg.cli import cli
from kvdbg.ts.window import analyze_window
from kvdbg.moves.picture import EXTRA, LOADED, MISSED, SEEN, cell_kind, picture
from kvdbg.render.drawing import COLORS, layout, png_bytes, svg_text
from kvdbg.render.picture import picture_lines
from kvdbg.replayer.runner import common_metadata
from kvdbg.moves.window_source import step_tables, window_source

from tests.helpers import FIXTURES, ROOT


def keys_of(row, kind):
    return {k for lo, hi, kd in row if kd == kind for k in range(lo, hi)}


def run(*args):
    return CliRunner().invoke(cli, ["window", *args], env={"NO_COLOR": "1", "COLUMNS": "80"})


def from_snapshot(path, request=None):
    source = window_source(path, request=request)
    a = analyze_window(source.seq_len, source.window, query_len=source.query_len, page_size=source.page_size,
                       causal=source.causal, max_model_len=source.max_model_len,
                       max_decode_query_len=source.max_decode_query_len)
    return picture(a, step_tables(path, source.step), source.request)


def test_dense_window_restriction_known_answer():
    """L 9000, w 4096, q 8, pages of 16: the kernel's keys start at 4896; token i's window at 4897 + i."""
    p = picture(analyze_window(9000, 4096, query_len=8, page_size=16))
    reference, ts = p.grids[0], p.grids[1]
    for i in range(8):
        assert keys_of(reference.rows[i], SEEN) == set(range(4897 + i, 9000))
        assert keys_of(ts.rows[i], EXTRA) == set(range(4896, 4897 + i))
        assert keys_of(ts.rows[i], SEEN) == set(range(4897 + i, 9000))
        assert not keys_of(ts.rows[i], MISSED)
    assert ts.counts()[EXTRA] == 36 and p.focus == 4896
    assert p.notes == ["flex needs the step's block table: give a snapshot to see it"]


def test_causal_window_loaded_pages_and_the_truncated_table():
    p = picture(analyze_window(70, 64, query_len=4, page_size=16, causal=True))
    ts = p.grids[1]
    assert ts.counts()[EXTRA] == ts.counts()[MISSED] == 0
    # The whole table is handed over: keys before each token's window, and after it (causal), are read and masked.
    assert [keys_of(row, LOADED) for row in ts.rows] == [set(range(0, 3 + i)) | set(range(67 + i, 70)) for i in range(4)]
    # Past max_kv_len the builder's 5-column table covers keys 0..79 only: every key of every window is missed.
    p = picture(analyze_window(200, 64, query_len=4, page_size=16, causal=True))
    assert [keys_of(row, MISSED) for row in p.grids[1].rows] == [set(range(133 + i, 197 + i)) for i in range(4)]


def test_flex_grid_on_prefix_page0_misses_the_null_block():
    p = from_snapshot(os.path.join(FIXTURES, "prefix_page0.safetensors"), request=1)
    flex = p.grids[2]
    assert flex.backend == "flex"
    assert keys_of(flex.rows[0], MISSED) == set(range(32, 48))  # logical block 2 sits on engine page 0
    assert "logical block(s) 2 masked" in flex.note
    assert p.focus == 32


@pytest.mark.parametrize("spec", [
    dict(seq_lens=(70, 45, 130, 20), query_lens=(3, 1, 20, 2), sliding_window=40, shared_prefix_pages=1,
         use_page_zero=True, page_zero_request=2, stale_tail=2),
    dict(seq_lens=(300, 90), query_len=8, sliding_window=50, causal=False),
    dict(seq_lens=(33, 64, 17), query_len=5, use_page_zero=True, page_zero_request=1),
])
def test_flex_grid_matches_the_flex_backend(make_snapshot, spec):
    """Every (token, key) flex attends to per the picture is one the backend's BlockMask lists and its mask_mod keeps."""
    path, snap = make_snapshot(**spec)
    md = get_backend("flex").create(snap.meta, ReplayOptions()).builder.build(common_metadata(snap, 0))
    ps = snap.page_size
    starts = md.query_start_loc.tolist()
    for r in range(len(starts) - 1):
        flex = from_snapshot(path, request=r).grids[2]
        for i, row in enumerate(flex.rows):
            t = starts[r] + i
            block = t // md.q_block_size
            seen, loaded = set(), set()
            for page in md.kv_indices[block, :int(md.kv_num_blocks[block])].tolist():
                logical = int(md.physical_to_logical[r, page])
                if logical < 0:
                    continue
                for off in range(ps):
                    key = logical * ps + off
                    if key >= int(md.seq_lens[r]):
                        continue
                    loaded.add(key)
                    if bool(md.mask_mod(0, 0, torch.tensor(t), torch.tensor(page * ps + off))):
                        seen.add(key)
            assert keys_of(row, SEEN) == seen, (r, i)
            assert keys_of(row, LOADED) == loaded - seen, (r, i)


def test_text_picture_fits_80_columns_with_overview_zoom_and_legend():
    p = from_snapshot(os.path.join(FIXTURES, "dflash.safetensors"))
    lines = [line.plain for line in picture_lines(p, 80)]
    drawn = [line for line in lines if line.startswith(" i ") or (line.startswith("     ") and line.strip())]
    assert drawn and all(len(line) <= 80 for line in drawn)  # grid rows and rulers; text lines wrap
    assert any(line.startswith("overview: keys 0..8999, one column = 120 keys") for line in lines)
    zoom = next(i for i, line in enumerate(lines) if line.startswith("zoom: "))
    ts_rows = [line for line in lines[zoom:] if line.startswith(" i ")][8:16]
    assert [row.count("+") for row in ts_rows] == list(range(1, 9))
    res = run(os.path.join(FIXTURES, "dflash.safetensors"), "--picture")
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert "legend: █ attended, and in the exact window" in " ".join(res.output.split())


def test_long_query_block_merges_rows_and_keeps_differences():
    p = picture(analyze_window(3000, 1000, query_len=40, page_size=16))
    lines = [line.plain for line in picture_lines(p, 100)]
    labels = [line.split()[1] for line in lines if line.lstrip().startswith("i ")]
    assert labels[:14] == [f"{i}-{i + 2}" for i in range(0, 39, 3)] + ["39"]
    assert len(labels) == 2 * 2 * 14  # two grids (no snapshot: no flex), overview and zoom
    assert cell_kind(p.grids[1].rows[39], 0, 3000) == EXTRA


def test_svg_and_png_show_the_same_layout(tmp_path):
    """The PNG is matplotlib's raster of the drawing the SVG writes: same size, the amber where the layout puts it."""
    pytest.importorskip("matplotlib")
    from PIL import Image  # matplotlib's own dependency

    p = from_snapshot(os.path.join(FIXTURES, "dflash.safetensors"))
    d = layout(p)
    root = ET.fromstring(svg_text(p))
    assert root.get("width") == str(d.width) and root.get("height") == str(d.height)
    fills = [e.get("fill") for e in root.iter("{http://www.w3.org/2000/svg}rect")]
    assert "#%02x%02x%02x" % COLORS[EXTRA] in fills
    data = png_bytes(p)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "w.png").write_bytes(data)
    image = Image.open(tmp_path / "w.png").convert("RGB")
    assert image.size == (d.width, d.height)
    extra = next(r for r in d.rects if r.color == COLORS[EXTRA])
    # The middle of the rectangle: its edges may be blended with the neighbours by the rasteriser.
    centre = image.getpixel((int(extra.x + extra.w / 2), int(extra.y + extra.h / 2)))
    assert all(abs(a - b) <= 2 for a, b in zip(centre, COLORS[EXTRA])), centre


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    res = run("--seq-len", "9000", "--window", "4096", "--png", str(tmp_path / "w.png"))
    assert res.exit_code == 2
    assert res.output.strip() == ("Error: --png needs matplotlib: pip install 'kvdbg[plot]' (SVG needs nothing)")
    assert not (tmp_path / "w.png").exists()


def test_cli_files_atomic_no_clobber_and_json(tmp_path):
    snap = os.path.join(FIXTURES, "prefix_page0.safetensors")
    svg, png = tmp_path / "w.svg", tmp_path / "w.png"
    res = run(snap, "--request", "1", "--svg", str(svg), "--png", str(png))
    # prefix_page0's one verdict: its live page 0 hides keys from FLEX_ATTENTION, an error finding of its inputs
    assert res.exit_code == 1, res.output
    assert svg.read_text().startswith("<svg") and png.read_bytes()[:4] == b"\x89PNG"
    res = run(snap, "--request", "1", "--svg", str(svg))
    assert res.exit_code == 2
    assert res.output.strip() == f"Error: --svg {svg} already exists; pass --force to replace it"
    assert run(snap, "--request", "1", "--svg", str(svg), "--force").exit_code == 1
    data = json.loads(run(snap, "--request", "1", "--picture", "--json").output)
    grids = {g["backend"]: g for g in data["picture"]["grids"]}
    assert grids["flex"]["counts"]["missed"] == 16 and grids["reference"]["counts"]["seen"] == 120
    assert list(data)[-1] == "verdict"


@pytest.mark.parametrize("png", [False, True])
def test_picture_does_not_import_torch(tmp_path, png):
    """SVG needs nothing heavy at all; PNG loads matplotlib (and so numpy), never torch."""
    if png:
        pytest.importorskip("matplotlib")
    files = f"'--svg', {str(tmp_path / 'a.svg')!r}" + (f", '--png', {str(tmp_path / 'a.png')!r}" if png else "")
    code = ("import sys\nfrom kvdbg.cli import main\n"
            f"sys.argv = ['kvdbg', 'window', {os.path.join(FIXTURES, 'dflash.safetensors')!r}, '--picture', "
            f"{files}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == ("HEAVY ['numpy']" if png else "HEAVY []")
    assert (tmp_path / "a.png").exists() == png
