"""`kvdbg report`: Markdown parsed back with markdown-it, digest, window section, SVG, exit codes, environment."""

from __future__ import annotations

import hashlib
import os
import xml.etree.ElementTree as ET

import pytest

from click.testing import CliRunner
from markdown_it import MarkdownIt

from kvdbg.cli import cli
from kvdbg.render.markdown import md_code, md_escape, md_table
from kvdbg.moves.report import file_sha256

from tests.helpers import FIXTURES, run_python

REPLAY_HEADERS = ["backend", "engine name", "status", "what ran", "vs reference", "max abs", "worst heads", "findings"]


def invoke(*args):
    return CliRunner().invoke(cli, ["report", *args], catch_exceptions=False)


def _text(inline) -> str:
    return "".join(c.content for c in inline.children or [] if c.content)


def parse(markdown: str) -> dict:
    """Headings, tables (header cells, body rows as cell texts) and fenced code of a Markdown document."""
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    out = {"headings": [], "tables": [], "fences": []}
    table = row = None
    in_head = False
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            out["headings"].append(_text(tokens[i + 1]))
        elif tok.type == "fence":
            out["fences"].append(tok.content)
        elif tok.type == "table_open":
            table = {"headers": [], "rows": []}
        elif tok.type == "thead_open":
            in_head = True
        elif tok.type == "thead_close":
            in_head = False
        elif tok.type == "tr_open":
            row = []
        elif tok.type in ("th_open", "td_open"):
            row.append(_text(tokens[i + 1]))
        elif tok.type == "tr_close":
            (table["headers"].__iadd__(row) if in_head else table["rows"].append(row))
        elif tok.type == "table_close":
            out["tables"].append(table)
            table = None
    return out


def table_with(doc: dict, headers: list[str]) -> dict:
    matches = [t for t in doc["tables"] if t["headers"] == headers]
    assert matches, f"no table with headers {headers}; have {[t['headers'] for t in doc['tables']]}"
    return matches[0]


def kv_table(doc: dict) -> dict[str, str]:
    return {row[0]: row[1] for row in table_with(doc, ["field", "value"])["rows"]}


def test_failing_snapshot_report_tables_digest_and_exit_1(make_snapshot, tmp_path):
    path, _ = make_snapshot(seq_lens=(40, 70, 100), steps=2, use_page_zero=True, page_zero_request=1)
    out = tmp_path / "report.md"
    res = invoke(path, "--backend", "flex", "-o", str(out))
    assert res.exit_code == 1, res.output
    # The document went to the file; the terminal gets where, and the verdict line (issue 44).
    assert " ".join(res.output.split()).startswith("report written to ")
    assert " ".join(res.output.split()).endswith("(exit 1)") and "#" not in res.output
    doc = parse(out.read_text())
    assert doc["headings"][1:] == ["Environment", "Snapshot", "Step 0: 3 requests, 3 query tokens, table width 7",
                                   "Step 1: 3 requests, 3 query tokens, table width 7", "Paging and window",
                                   "Map anomalies", "Window restriction", "Replay", "Findings", "Reproduce"]
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    snapshot = kv_table(doc)
    assert snapshot["sha256"] == digest
    assert snapshot["heads"] == "Hq 8 / Hkv 2, head_size 64, scale 0.125"
    assert snapshot["steps"] == "2"
    lengths = table_with(doc, ["request", "seq_len", "query_len", "live pages"])
    assert lengths["rows"] == [["0", "40", "1", "3"], ["1", "70", "1", "5"], ["2", "100", "1", "7"]]

    anomalies = table_with(doc, ["step", "severity", "code", "request", "message"])
    assert ["0", "error", "live_page_zero", "1"] in [r[:4] for r in anomalies["rows"]]
    assert ["1", "error", "live_page_zero", "1"] in [r[:4] for r in anomalies["rows"]]

    replay = table_with(doc, REPLAY_HEADERS)
    assert [r[0] for r in replay["rows"]] == ["reference", "flex"]
    flex = dict(zip(REPLAY_HEADERS, replay["rows"][1]))
    assert flex["engine name"] == "FLEX_ATTENTION" and flex["status"] == "ran"
    assert flex["vs reference"] == "FAIL (16 of 48 heads)"  # request 1's 8 heads on both steps
    assert flex["worst heads"].count("req 1 head") == 3
    assert flex["findings"] == "live_page_zero ×2"
    assert "flex_attention (eager)" in flex["what ran"]

    # flex's two findings are the map's two anomalies (one code per condition): listed once, under the map.
    assert not [t for t in doc["tables"] if t["headers"] == ["severity", "backend", "step", "request", "code",
                                                                "message"]]
    assert "2 finding(s) of the replay (flex: live\\_page\\_zero) are the map anomalies listed above" \
        in out.read_text()
    assert "What it means and what to do: `kvdbg explain live_page_zero`." in out.read_text()
    (fence,) = doc["fences"]
    name = os.path.basename(path)
    assert fence.splitlines() == [f"echo '{digest}  {name}' | sha256sum -c -", f"kvdbg replay {name} --backend flex"]
    for table in doc["tables"]:
        assert all(len(row) == len(table["headers"]) for row in table["rows"])


def test_clean_snapshot_to_stdout_exits_0(make_snapshot):
    path, _ = make_snapshot(seq_lens=(30, 50))
    res = invoke(path, "--backend", "flex", "--backend", "flashinfer_ts")
    assert res.exit_code == 0, res.output
    doc = parse(res.output)
    assert doc["headings"][0] == f"kvdbg report: {os.path.basename(path)}"
    rows = {r[0]: r for r in table_with(doc, REPLAY_HEADERS)["rows"]}
    assert rows["flex"][4] == "pass (16 heads)" and rows["flashinfer_ts"][4] == "pass (16 heads)"
    assert "(emulated)" in rows["flashinfer_ts"][3]
    assert "PASSED" in res.output
    assert doc["fences"][0].splitlines()[1].endswith("--backend flex --backend flashinfer_ts")


def test_dense_window_restriction_per_request(make_snapshot):
    path, _ = make_snapshot(seq_lens=(300, 40), query_len=4, causal=False, sliding_window=64, shuffle=False)
    res = invoke(path, "--backend", "flashinfer_ts")
    assert res.exit_code in (0, 1), res.output
    doc = parse(res.output)
    window = table_with(doc, ["step", "request", "seq_len", "query_len", "restricted", "start page", "pages dropped",
                              "kernel seq_len", "worst extra keys", "drift", "findings"])
    span = 64 + 4 - 1
    start = (300 - span) // 16  # the builder's page-aligned window start
    assert window["rows"][0][:8] == ["0", "0", "300", "4", "yes", str(start), str(start), str(300 - start * 16)]
    assert window["rows"][1][:5] == ["0", "1", "40", "4", "no"]
    assert int(window["rows"][0][9]) == 3  # one shared window start for the 4-token block


def test_markdown_escaping_keeps_cells_intact(make_snapshot):
    tricky = "a|b `c` *d* _e_ [f](g) <h> \\i"
    doc = parse(md_table(["x", "y"], [[md_escape(tricky), md_code("p|q`r")]]))
    assert doc["tables"][0]["rows"] == [[tricky, "p|q`r"]]
    assert md_escape("two\nlines") == "two lines"

    path, _ = make_snapshot(seq_lens=(20,), layer_name="model|layers.0`attn_x*", notes="see | pipe\nsecond line")
    res = invoke(path, "--backend", "flex")
    fields = kv_table(parse(res.output))
    assert fields["layer"] == "model|layers.0`attn_x*"
    assert fields["notes"] == "see | pipe second line"


def test_svg_images_are_valid_and_output_refuses_overwrite(make_snapshot, tmp_path):
    path, _ = make_snapshot(seq_lens=(20, 40), use_page_zero=True, page_zero_request=0)
    out, svg = tmp_path / "r.md", tmp_path / "figs"
    assert invoke(path, "--backend", "flex", "-o", str(out), "--svg", str(svg)).exit_code == 1
    for stem in ("info", "map", "replay"):
        root = ET.parse(svg / f"{stem}.svg").getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert len(list(root.iter("{http://www.w3.org/2000/svg}text"))) > 10
    assert "live_page_zero" in (svg / "replay.svg").read_text().replace("&#160;", " ")
    before = out.read_text()
    res = invoke(path, "--backend", "flex", "-o", str(out))
    assert res.exit_code == 2
    assert res.output.strip() == f"Error: -o {out} already exists; pass --force to replace it"
    res = invoke(path, "--backend", "flex", "--svg", str(svg))
    assert res.exit_code == 2 and "info.svg already exists" in res.output
    assert invoke(path, "--backend", "flex", "-o", str(out), "--svg", str(svg), "--force").exit_code == 1
    assert out.read_text() == before


def test_bad_input_exits_2_on_one_line(tmp_path):
    res = invoke(str(tmp_path / "missing.safetensors"))
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith("Error:")
    res = invoke(str(tmp_path / "missing.safetensors"), "--backend", "nope")
    assert res.exit_code == 2


def test_file_sha256_streams(tmp_path):
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_sha256(path, chunk_size=1000) == hashlib.sha256(data).hexdigest()


def test_environment_reads_versions_without_importing_engines():
    out = run_python(
        "import sys, torch\n"
        "from kvdbg.moves.report import collect_environment\n"
        "e = collect_environment()\n"
        "print(e.torch == torch.__version__, 'vllm' in sys.modules, 'flashinfer' in sys.modules,"
        " sorted(e.packages)[:2], e.cuda_available == torch.cuda.is_available())\n")
    assert out.strip() == "True False False ['click', 'flashinfer'] True"


def test_report_parses_the_snapshot_once_and_digests_what_it_loaded(make_snapshot, monkeypatch):
    import kvdbg.snapshot.format as fmt
    import kvdbg.snapshot.info as summary
    from kvdbg.errors import SnapshotError
    from kvdbg.moves.report import build_report
    from kvdbg.snapshot.store import load_snapshot

    path, _ = make_snapshot(seq_lens=(30, 50), use_page_zero=True, page_zero_request=1)
    parsed, index_reads = [], []
    real_header, real_index = fmt.read_raw_header, summary.read_index_tensor
    monkeypatch.setattr(fmt, "read_raw_header", lambda p: parsed.append(p) or real_header(p))
    monkeypatch.setattr(summary, "read_index_tensor", lambda h, n: index_reads.append(n) or real_index(h, n))
    report = build_report(path, ["flex"])
    assert len(parsed) == 1 and index_reads == []  # load_snapshot's header serves the summary too
    assert [q.seq_len for q in report.summary.steps[0].requests] == [30, 50]
    with open(path, "rb") as fh:
        assert report.sha256 == hashlib.sha256(fh.read()).hexdigest()
    assert report.verdict is report.replay.verdict and report.verdict.exit_code == 1

    snap = load_snapshot(path)
    parsed.clear()
    again = build_report(snap, ["flex"])  # a loaded snapshot is used as it is
    assert parsed == [] and again.sha256 == report.sha256 and again.verdict == report.verdict
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed after loading
    with pytest.raises(SnapshotError, match="changed while the report was made"):
        build_report(snap, ["flex"])


@pytest.mark.parametrize("under", ["a_file", "missing_parent_of_a_file"])
def test_svg_directory_that_cannot_be_made_is_refused_before_the_replay(make_snapshot, tmp_path, monkeypatch, under):
    """--svg under a regular file: one line naming --svg, exit 2, and no replay spent first."""
    import kvdbg.moves.report

    path, _ = make_snapshot(seq_lens=(20, 40))
    (tmp_path / "a_file").write_text("not a directory")
    svg = tmp_path / "a_file" / "figs" if under == "a_file" else tmp_path / "a_file" / "deeper" / "figs"
    replayed = []
    monkeypatch.setattr(kvdbg.moves.report, "build_report", lambda *a, **k: replayed.append(1))
    res = invoke(path, "--backend", "reference", "--svg", str(svg))
    assert res.exit_code == 2 and not replayed
    assert res.output.strip() == f"Error: --svg-dir {svg}: cannot write the directory (Not a directory)"


def test_svg_directory_made_for_a_bad_snapshot_is_not_left_behind(tmp_path):
    svg = tmp_path / "figs" / "a" / "b"
    res = invoke(str(tmp_path / "missing.safetensors"), "--svg", str(svg))
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nor the parents it made


def test_a_refused_output_makes_no_svg_directory(tmp_path):
    existing = tmp_path / "r.md"
    existing.write_text("mine\n")
    res = invoke(os.path.join(FIXTURES, "causal_gqa.safetensors"), "-o", str(existing), "--svg",
                 str(tmp_path / "new" / "figs"))
    assert res.exit_code == 2 and "already exists" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md"] and existing.read_text() == "mine\n"


def test_svg_directory_is_made_with_its_parents(make_snapshot, tmp_path):
    path, _ = make_snapshot(seq_lens=(20, 40), engine_output="reference")
    svg = tmp_path / "new" / "figs"
    assert invoke(path, "--backend", "reference", "-o", str(tmp_path / "r.md"), "--svg", str(svg)).exit_code == 0
    assert {"info.svg", "map.svg", "replay.svg", "errors.svg"} <= {p.name for p in svg.iterdir()}
    assert not [p for p in svg.iterdir() if p.name.startswith(".")]  # the write probe is gone


def test_the_reproducing_command_gives_the_reports_verdict(make_snapshot):
    """Without --backend the report runs the defaults, whose what-if columns do not count: the command it prints
    names none, since naming one judges it (here flashinfer_ts, which fails on this FLEX_ATTENTION capture)."""
    path, _ = make_snapshot(seq_lens=(1000, 200, 70), query_len=4, num_heads=4, num_kv_heads=1, head_size=64,
                            sliding_window=256, backend="FLEX_ATTENTION", engine_output="reference")
    res = invoke(path)
    assert res.exit_code == 0, res.output
    command = parse(res.output)["fences"][0].splitlines()[1]
    assert command == f"kvdbg replay {os.path.basename(path)}"
    replayed = CliRunner().invoke(cli, ["replay", path])
    assert replayed.exit_code == res.exit_code and "what-if column(s) flashinfer_ts fail" in replayed.output


# --------------------------------------------------------------------------- issue 44


def test_report_to_files_ends_on_its_verdict_line(tmp_path, monkeypatch):
    """Issue 44: `report SNAP -o r.md --html r.html` printed nothing and exited 1; it says what it found now."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["report", os.path.join(FIXTURES, "prefix_page0.safetensors"), "-o", "r.md",
                                   "--html", "r.html"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert lines[0] == "report written to r.md, r.html" and max(len(line) for line in lines) <= 80
    assert " ".join(" ".join(lines[1:]).split()) == (
        "FAIL: 2 of 2 comparison(s) failed (flex vs reference); 2 error finding(s) (live_page_zero) (exit 1)")
    assert (tmp_path / "r.md").read_text().rstrip().splitlines()[-1].startswith(
        "**Verdict:** FAIL: 2 of 2 comparison(s)")
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_report_html_draws_a_nan_key(nan_k_snapshot, tmp_path):
    """Issue 44: NaN in a live K slot crashed `report --html` in the attention picture; no file was written."""
    from tests.nan_snapshot import NAN_KEY

    page = tmp_path / "nan.html"
    res = invoke(nan_k_snapshot, "-o", str(tmp_path / "nan.md"), "--html", str(page))
    assert res.exit_code == 1, res.output
    html = page.read_text()
    assert '<figure id="attention-picture"><svg' in html
    assert f"NaN/Inf in K at key {NAN_KEY}" in html
    assert "nonfinite_kv" in (tmp_path / "nan.md").read_text()
    assert "FAIL" in res.output.splitlines()[-1] and "PASS" not in res.output


def test_a_failing_backend_row_states_its_failing_heads_error():
    """Issue 44: flashinfer_ts's 4 failing heads on ts_causal_window are unwritten (no finite error); its row
    quoted the largest error of a passing head (1.79e-03) as the FAIL's max abs."""
    res = invoke(os.path.join(FIXTURES, "ts_causal_window.safetensors"))
    assert res.exit_code == 1
    row = dict(zip(REPLAY_HEADERS, next(r for r in table_with(parse(res.output), REPLAY_HEADERS)["rows"]
                                        if r[0] == "flashinfer_ts")))
    assert row["vs reference"] == "FAIL (4 of 12 heads)" and row["max abs"] == "no finite error"
    flex = next(r for r in table_with(parse(res.output), REPLAY_HEADERS)["rows"] if r[0] == "flex")
    assert flex[4].startswith("pass") and 1e-4 < float(flex[5]) < 1.6e-2  # a passing row keeps its number
