"""Issue 16's defects, one regression test each: exact messages, one-line usage errors, strict options."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli

from tests.helpers import FIXTURES as _FIXTURES

FIXTURES = pathlib.Path(_FIXTURES)


def invoke(*args, width: int = 120):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": str(width), "NO_COLOR": "1"},
                              catch_exceptions=False)


def one_line_error(res, *needles: str) -> str:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- one-line usage errors

@pytest.mark.parametrize("args, needle", [
    (("info", str(FIXTURES)), "is a directory"),
    (("replay", FIXTURES / "causal_gqa.safetensors", "-o", str(FIXTURES)), "'-o' / '--output'"),
    (("replay", FIXTURES / "causal_gqa.safetensors", "--save-outputs", str(FIXTURES)), "'-o' / '--output'"),
    (("window",), "give SNAPSHOT, or --seq-len"),
    (("window", "--seq-len", "100", "--mask", "bogus"), "--mask"),
    (("synth", "/nonexistent/x.safetensors", "--mask", "diagonal"), "--mask"),
    (("--no-such-flag",), "--no-such-flag"),
])
def test_usage_errors_are_one_line(args, needle):
    one_line_error(invoke(*args), needle)


def test_mistyped_subcommand_gets_a_suggestion():
    line = one_line_error(invoke("repaly", "x"), "No such command 'repaly'")
    assert "Did you mean 'replay'?" in line


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("option, value", [("--rtol", "1e400"), ("--atol", "inf"), ("--atol", "nan"),
                                           ("--atol", "-1")])
def test_non_finite_or_negative_tolerances_are_refused_alike(option, value):
    line = one_line_error(invoke("replay", FIXTURES / "causal_gqa.safetensors", option, value), option)
    assert "finite" in line or "non-negative" in line


def test_json_is_strict_even_where_statistics_are_nan(make_snapshot):
    # Request 2 reads the null block: flex leaves NaN-free but wrong output; cosine etc. stay finite.
    # The unwritten tokens of ts_causal_window make max abs / cosine NaN: JSON must still parse strictly.
    res = invoke("replay", FIXTURES / "ts_causal_window.safetensors", "--backend", "flashinfer_ts", "--json")
    assert res.exit_code == 1

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    data = json.loads(res.output, parse_constant=refuse)
    heads = [h for c in data["comparisons"] for h in c["heads"]]
    assert any(h["cosine"] is None for h in heads)  # a NaN statistic became null


def test_synth_head_size_message_names_the_option():
    one_line_error(invoke("synth", "-o", "/tmp/never-written.safetensors", "--head-size", "0"),
                   "--head-size must be positive, got 0")


def test_window_seq_len_beyond_int32_is_refused():
    one_line_error(invoke("window", "--seq-len", "99999999999", "--window", "4096"),
                   "--seq-len 99999999999 is beyond int32 (2147483647)")


@pytest.mark.parametrize("name", ["FLEX_ATTENTION", "Flex", "flex", "FLASHINFER_TS", "flashinfer"])
def test_backend_names_case_insensitive_and_engine_names(name):
    from kvdbg.cli.common import backend_name

    assert backend_name(name) == ("flex" if "flex" in name.lower() else "flashinfer_ts")


def test_replay_accepts_engine_name_and_suggests_for_a_typo(make_snapshot):
    path, _ = make_snapshot(seq_lens=(20, 30), num_heads=4, num_kv_heads=2, head_size=16)
    res = invoke("replay", path, "--backend", "FLEX_ATTENTION", "--json")
    assert res.exit_code == 0, res.output
    assert [b["name"] for b in json.loads(res.output)["backends"]] == ["reference", "flex"]
    line = one_line_error(invoke("replay", path, "--backend", "flexx"), "unknown backend 'flexx'")
    assert "did you mean flex?" in line


# --------------------------------------------------------------------------- replay tables


@pytest.fixture
def page_zero(make_snapshot):
    """Request 2 of 3 reads physical page 0 (flex masks it as the null block); two steps, q=3."""
    return make_snapshot(seq_lens=(20, 40, 60), num_heads=4, num_kv_heads=2, head_size=16, query_len=3,
                         use_page_zero=True, page_zero_request=2, steps=2)


def test_worst_token_is_the_requests_own_index(page_zero):
    path, snap = page_zero
    data = json.loads(invoke("replay", path, "--backend", "flex", "--step", "0", "--json").output)
    comp = data["comparisons"][0]
    failing = [h for h in comp["heads"] if not h["passed"]]
    assert failing and {h["request"] for h in failing} == {2}
    qsl = snap.steps[0].query_start_loc.tolist()
    for h in failing:
        assert h["worst_token_in_request"] == h["worst_token"] - qsl[2]
        assert 0 <= h["worst_token_in_request"] < 3
        assert h["worst_token"] >= 6  # the batch-wide row is not the request's own index
    table = invoke("replay", path, "--backend", "flex", "--step", "0").output
    h = failing[0]
    row = next(line for line in table.splitlines() if re.match(rf"│\s+2 │\s+{h['head']} │ FAIL", line))
    assert f"{h['worst_token_in_request']} ({h['worst_position']})" in row
    assert "failing elements" in " ".join(table.split())  # the header says what it counts


def test_findings_are_listed_once_with_their_steps(page_zero):
    path, _ = page_zero
    data = json.loads(invoke("replay", path, "--backend", "flex", "--json").output)
    assert sorted(f["step"] for f in data["findings"] if f["code"] == "live_page_zero") == [0, 1]
    table = invoke("replay", path, "--backend", "flex").output
    rows = [line for line in table.splitlines() if "│ live_page_zero" in line]
    assert len(rows) == 1 and re.search(r"│ 0, 1\s+│", rows[0]), rows
    assert "findings (1, all flex)" in table
    assert "the other steps' numbers differ" in " ".join(table.replace("│", " ").split())


def test_request_narrows_findings_and_the_exit_code(page_zero):
    path, _ = page_zero
    whole = invoke("replay", path, "--backend", "flex")
    assert whole.exit_code == 1
    narrowed = invoke("replay", path, "--backend", "flex", "--request", "0-1", "--json")
    assert narrowed.exit_code == 0, narrowed.output
    data = json.loads(narrowed.output)
    assert not [f for f in data["findings"] if f["request"] == 2]
    assert data["verdict"]["status"] == "pass" and list(data)[-1] == "verdict"
    assert invoke("replay", path, "--backend", "flex", "--request", "2").exit_code == 1


def test_unavailable_reason_has_its_own_section():
    table = invoke("replay", FIXTURES / "prefix_page0.safetensors", width=120).output
    data = json.loads(invoke("replay", FIXTURES / "prefix_page0.safetensors", "--json").output)
    reason = next(b["reason"] for b in data["backends"] if b["name"] == "flashinfer_ts")
    backends = table[table.index("backends"):table.index("unavailable backends")]
    flat = " ".join(table[table.index("unavailable backends"):].replace("│", " ").split())
    assert reason.split()[0] in flat and " ".join(reason.split()[:6]) in flat
    assert "kv_layout" not in backends and "see below" in backends


def test_explain_is_key_value_without_python_reprs():
    res = invoke("replay", FIXTURES / "dflash.safetensors", "--backend", "flashinfer_ts", "--explain", width=80)
    text = res.output
    assert "step 0, request 0: builder decisions" in text and "step 0, request 1: builder decisions" in text
    assert "restriction.span" in text and "plan_key" in text
    assert "{'" not in text and "':" not in text and "[2, 8, False]" not in text
    assert "2, 8, no" in text


def test_replay_ends_on_the_verdict_line():
    res = invoke("replay", FIXTURES / "causal_gqa.safetensors", width=80)
    last = res.output.rstrip().split("\n\n")[-1]  # the verdict paragraph, wrapped at 80 columns
    assert " ".join(last.split()) == (
        "PASS: 3 comparison(s) agree within tolerance, no error finding; what-if column(s) flex pass too "
        "(exit 0)")


# --------------------------------------------------------------------------- window


def test_page_size_beyond_the_strip_keeps_the_title_on_one_line():
    res = invoke("window", "--seq-len", "9000", "--window", "4096", "--page-size", "100000", width=80)
    assert "pages around the window's old edge and the query block" in res.output.splitlines()


def test_causal_legend_does_not_promise_extra_tokens_that_are_not_there():
    causal = invoke("window", "--seq-len", "5000", "--window", "4096", "--mask", "causal", "--json")
    assert json.loads(causal.output)["visibility"]["worst_extra"] == 0
    text = invoke("window", "--seq-len", "5000", "--window", "4096", "--mask", "causal").output
    assert "P partly inside the window (the kernel masks the rest: 0 extra keys)" in " ".join(text.split())
    assert "extra tokens)" not in text
    dense = invoke("window", "--seq-len", "9000", "--window", "4096", "--query-len", "8").output
    assert "P partly inside the window (up to 8 extra keys visible to the kernel)" in " ".join(dense.split())


@pytest.mark.parametrize("args, status, code", [
    (("--seq-len", "9000", "--window", "4096", "--query-len", "8"), "pass", 0),
    (("--seq-len", "9000", "--window", "4096", "--page-size", "100000"), "fail", 1),
])
def test_window_verdict_is_last_line_and_in_json(args, status, code):
    res = invoke("window", *args)
    assert res.exit_code == code
    assert res.output.rstrip().splitlines()[-1].startswith(("PASS: ", "FAIL: ")[code])
    assert res.output.rstrip().endswith(f"(exit {code})")
    data = json.loads(invoke("window", *args, "--json").output)
    assert data["verdict"]["status"] == status and data["verdict"]["exit_code"] == code


# --------------------------------------------------------------------------- map / info


def test_map_verdict_is_last_line_and_in_json():
    res = invoke("map", FIXTURES / "prefix_page0.safetensors")
    assert res.exit_code == 1
    assert res.output.rstrip().splitlines()[-1] == \
        "FAIL: 1 error finding(s) (live_page_zero) in the inputs of step 0 (exit 1)"
    data = json.loads(invoke("map", FIXTURES / "causal_gqa.safetensors", "--json").output)
    assert data["verdict"]["status"] == "pass" and data["verdict"]["exit_code"] == 0


def test_info_check_says_it_checked_and_fails_on_nan_pages(tmp_path):
    from tests.test_hostile_regressions import _snap_with_bad_pages

    clean = invoke("info", FIXTURES / "causal_gqa.safetensors", "--check")
    assert clean.exit_code == 0
    assert "PASS: checked every page id, length and offset" in " ".join(clean.output.split())
    assert clean.output.rstrip().endswith("(exit 0)")
    plain = invoke("info", FIXTURES / "causal_gqa.safetensors")
    assert "not checked" in plain.output.rstrip().splitlines()[-1]
    path, _ = _snap_with_bad_pages(tmp_path, nan=True)
    assert invoke("info", path).exit_code == 0  # the header alone cannot see page contents
    bad = invoke("info", path, "--check")
    assert bad.exit_code == 1, bad.output
    assert "nonfinite_kv" in bad.output and bad.output.rstrip().endswith("(exit 1)")
    data = json.loads(invoke("info", path, "--check", "--json").output)
    assert [e["code"] for e in data["check_errors"]] == ["nonfinite_kv"]
    assert data["verdict"]["exit_code"] == 1


# --------------------------------------------------------------------------- shrink


def test_shrink_on_a_passing_snapshot_says_the_backend_passes(tmp_path):
    """The snapshot's verdict, as `kvdbg replay` gives it (PASS, exit 0), and that nothing was written."""
    res = invoke("shrink", FIXTURES / "causal_gqa.safetensors", "-o", tmp_path / "never.st", "--backend", "Flex")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert text.startswith("PASS: ") and text.endswith("nothing to shrink, no file written (exit 0)")
    assert not (tmp_path / "never.st").exists()


def test_shrink_refuses_to_overwrite_its_own_input(tmp_path):
    target = tmp_path / "in.safetensors"
    shutil.copy(FIXTURES / "prefix_page0.safetensors", target)
    before = target.read_bytes()
    one_line_error(invoke("shrink", target, "-o", target, "--force"), "is an input of this command")
    assert target.read_bytes() == before


# --------------------------------------------------------------------------- report


def test_report_svgs_are_self_contained_titled_by_what_ran_and_free_of_local_paths(tmp_path, monkeypatch):
    import sys

    home = os.path.expanduser("~")
    snap = tmp_path / "snap.safetensors"
    shutil.copy(FIXTURES / "prefix_page0.safetensors", snap)
    res = invoke("report", snap, "--svg", tmp_path / "svg", "-o", tmp_path / "report.md")
    assert res.exit_code == 1, res.output
    report = (tmp_path / "report.md").read_text()
    if sys.prefix != sys.base_prefix:
        assert sys.prefix not in report and "<venv>/" in report
    if home not in ("/", ""):
        assert home + "/" not in report
    assert report.rstrip().splitlines()[-1].startswith("**Verdict:** FAIL")
    svgs = {p.stem: p.read_text() for p in (tmp_path / "svg").glob("*.svg")}
    assert set(svgs) == {"info", "map", "replay", "errors", "attention", "window"}
    for stem, svg in svgs.items():
        assert "@font-face" not in svg and "cdnjs" not in svg and "woff" not in svg
        assert ("font-family: DejaVu Sans Mono" if stem in ("info", "map", "replay")
                else 'font-family="DejaVu Sans Mono') in svg
        if stem not in ("info", "map", "replay"):
            assert str(tmp_path) not in svg
    title = re.search(r'class="terminal-[0-9]+-title"[^>]*>([^<]*)<', svgs["replay"]).group(1)
    assert "reference, flex ran on cpu" in title.replace("&#160;", " ")
    assert "--backend" not in title


def test_shrink_ends_on_its_verdict_in_text_and_json(make_snapshot, tmp_path):
    path, _ = make_snapshot(seq_lens=(30, 50), num_heads=4, num_kv_heads=2, head_size=16, use_page_zero=True,
                            page_zero_request=0)
    res = invoke("shrink", path, "-o", tmp_path / "a.safetensors", "--backend", "FLEX_ATTENTION")
    # The snapshot's verdict (flex named, so counted: FAIL, exit 1, as `kvdbg replay --backend flex` says),
    # then what was shrunk.
    assert res.exit_code == 1, res.output
    last = " ".join(res.output.split()[-60:])
    assert re.search(r"FAIL: .*; shrunk: flex still fails on \d+ \(request, head\) pair\(s\) in "
                     r"\S+a\.safetensors \(exit 1\)$", last), last
    res = invoke("shrink", path, "-o", tmp_path / "b.safetensors", "--json")
    data = json.loads(res.output)
    replayed = json.loads(invoke("replay", path, "--json").output)["verdict"]
    assert list(data)[-1] == "verdict" and data["verdict"]["status"] == replayed["status"]
    assert res.exit_code == data["verdict"]["exit_code"] == replayed["exit_code"]
    assert "; shrunk: flex still fails" in data["verdict"]["summary"]


def test_report_lists_unavailable_backends_apart_from_what_ran():
    res = invoke("report", FIXTURES / "prefix_page0.safetensors")
    assert res.exit_code == 1
    row = next(line for line in res.output.splitlines() if line.startswith("| `flashinfer_ts` |"))
    assert "kv\\_layout" not in row and "| unavailable | - |" in row
    section = res.output[res.output.index("### Backends that did not run"):]
    assert section.splitlines()[2].startswith("- `flashinfer_ts`: kv\\_layout")


def test_report_svg_writes_the_pictures_and_their_pngs(tmp_path):
    """Tables as SVG; the pictures as SVG and, with the plot extra, PNG (matplotlib)."""
    pytest.importorskip("matplotlib")
    res = invoke("report", FIXTURES / "causal_gqa.safetensors", "--backend", "flex", "--svg", tmp_path / "svg",
                 "-o", tmp_path / "r.md")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "svg").iterdir()) == [
        "attention.png", "attention.svg", "errors.png", "errors.svg", "info.svg", "map.svg", "replay.svg",
        "window.png", "window.svg"]
    assert all((tmp_path / "svg" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
               for stem in ("attention", "errors", "window"))


# --------------------------------------------------------------------------- issue 44: a required -o


def _commands_with_required_output() -> list[str]:
    """Every command whose -o (kvdbg.cli.common.output_option) is required, read from the commands themselves."""
    import click

    from kvdbg.cli import COMMANDS

    names = []
    for name in sorted(COMMANDS):
        command = cli.get_command(None, name)
        if any(isinstance(p, click.Option) and p.name == "output" and p.required for p in command.params):
            names.append(name)
    return names


def test_shrink_and_merge_are_the_commands_whose_output_is_required():
    assert _commands_with_required_output() == ["merge", "shrink"]


@pytest.mark.parametrize("command", _commands_with_required_output())
def test_a_required_output_left_out_is_a_one_line_usage_error(command, tmp_path):
    """Issue 44: click 8.3 took output_option's default=None for a value, so `shrink SNAP` ran on with no
    path and died in check_output (TypeError traceback, exit 1)."""
    snap = tmp_path / "in.safetensors"
    shutil.copy(FIXTURES / "causal_gqa.safetensors", snap)
    line = one_line_error(invoke(command, snap))
    assert line == "Error: Missing option '-o' / '--output'."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]  # nothing written
