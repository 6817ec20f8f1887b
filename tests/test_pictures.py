"""Error maps, the error over steps and where the attention went: known answers on the fixtures, text and files."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from kvdbg import api
from kvdbg.snapshot.cache import apply_step_update, replay_cache
from kvdbg.snapshot.layout import kv_views
from kvdbg.cli import cli
from kvdbg.judge.errormap import FAR, Cell, ErrorMap, ErrorPictures, error_pictures, grade
from kvdbg.render.attention import AttentionText, attention_drawing
from kvdbg.render.canvas import svg_text
from kvdbg.render.errormap import ErrorMapText, error_drawing, map_lines
from kvdbg.snapshot.store import load_snapshot

from tests.helpers import FIXTURES

DFLASH = f"{FIXTURES}/dflash.safetensors"
PAGE0 = f"{FIXTURES}/prefix_page0.safetensors"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"NO_COLOR": "1", "COLUMNS": "80"})


def text_of(renderable, width=80) -> list[str]:
    console = Console(record=True, width=width, no_color=True, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text().splitlines()


# --------------------------------------------------------------------------- error maps


def test_prefix_page0_error_map_marks_request_1_in_both_steps():
    pictures = error_pictures(api.replay(PAGE0))
    flex = next(m for m in pictures.maps if m.actual == "flex" and m.expected == "reference")
    assert flex.steps == [0, 1] and flex.counted
    assert sorted((c.request, c.head) for c in flex.failed) == [(1, h) for h in range(8)]
    rows = {line.split()[1]: line for line in text_of(ErrorMapText(pictures)) if line.strip().startswith("r ")}
    assert set(rows["1"].split()[-1]) == {"X"} and "X" not in rows["0"] and "X" not in rows["2"]
    series = next(s for s in pictures.series if s.actual == "flex")
    assert [p.failed_heads for p in series.points] == [8, 8] and series.first_failure == 0


def test_a_failing_cell_survives_grouping_and_the_map_fits_80_columns():
    """2048 cells (64 requests x 32 heads) with one failure: grouped rows still show it; every line fits."""
    m = ErrorMap("flex", "reference", [0], True, 1e-2, 1e-2, list(range(64)), list(range(32)))
    for r in range(64):
        for h in range(32):
            m.cells[(r, h)] = Cell(r, h, 0, 1e-5, False, "", 0, grade(1e-5, 1e-2))
    m.cells[(45, 17)] = Cell(45, 17, 0, 0.5, True, "", 3, FAR)
    lines = text_of(ErrorMapText(ErrorPictures("x", [m], [], [0])))
    assert max(len(line) for line in lines) <= 80
    failing = [line for line in lines if "X" in line and line.lstrip().startswith("r ")]
    assert len(failing) == 1 and failing[0].lstrip().startswith("r 44-45")
    assert len([line for line in lines if line.lstrip().startswith("r ") and "-" in line]) == 32
    full = [t.plain for t in map_lines(m, 80, full=True) if t.plain.lstrip().startswith("r ")]
    assert len(full) == 64
    svg = svg_text(error_drawing(ErrorPictures("x", [m], [], [0])))
    assert ET.fromstring(svg).tag.endswith("svg") and svg.count('fill="#cb181d"') >= 2  # the cell and the legend


def test_replay_picture_text_json_and_files(tmp_path):
    res = run("replay", PAGE0, "--picture", "--svg", tmp_path / "e.svg")
    assert res.exit_code == 1, res.output
    lines = res.output.rstrip().splitlines()
    assert lines[-2].startswith("FAIL") and any("error over steps" in line for line in lines)
    assert max(len(line) for line in lines) <= 80
    assert ET.parse(tmp_path / "e.svg").getroot().tag.endswith("svg")
    res = run("replay", PAGE0, "--picture", "--json")
    data = json.loads(res.output)
    assert list(data)[-2:] == ["pictures", "verdict"]
    flex = next(m for m in data["pictures"]["maps"] if m["actual"] == "flex")
    assert flex["failed_cells"] == 8 and flex["worst"]["request"] == 1
    res = run("replay", PAGE0, "--svg", tmp_path / "e.svg")
    assert res.exit_code == 2 and "already exists" in res.output


# --------------------------------------------------------------------------- where the attention went


def _exact_weights(path, step, request, head, token):
    """Independent float64 softmax of one token over the keys of one request (the reference's mask)."""
    snap = load_snapshot(path)
    meta, s = snap.meta, snap.steps[step]
    cache = replay_cache(snap, "cpu", range(step + 1))
    for earlier in range(step + 1):  # the step's new keys are written before attention, as the engine does
        apply_step_update(snap, cache, earlier)
    k_pages, _ = kv_views(meta, cache)
    ps, length = snap.page_size, int(s.seq_lens[request])
    start = int(s.query_start_loc[request])
    qlen = int(s.query_start_loc[request + 1]) - start
    table = snap.stored_block_table(step)[request, :math.ceil(length / ps)]
    kvh = head // (meta.layer.num_heads // meta.layer.num_kv_heads)
    keys = k_pages[table, kvh].reshape(-1, meta.layer.head_size)[:length].double()
    logits = keys @ s.query[start + token, head].double() * meta.layer.scale
    return logits, length - qlen + token


def test_dflash_flashinfer_ts_weights_key_4896_one_before_the_window(tmp_path):
    p = api.attention(DFLASH, step=0, request=0, head=0, token=0)
    assert p.exact == (4897, 9000)
    ts, ref, flex = p.column("flashinfer_ts"), p.column("reference"), p.column("flex")
    assert [k for k, _ in ts.forbidden_keys] == [4896] and ts.forbidden_count == 1
    logits, position = _exact_weights(DFLASH, 0, 0, 0, 0)
    expected = torch.softmax(logits[4896:], 0)[0].item()  # the kernel's keys: 4896 .. 8999
    assert ts.forbidden_keys[0][1] == pytest.approx(expected, rel=1e-9)
    assert ts.forbidden_mass == pytest.approx(expected, rel=1e-9)
    # ... and that key is the page-aligned restriction's own: documented, all of the mass outside the mask
    assert ts.documented_count == 1 and ts.documented_mass == pytest.approx(expected, rel=1e-9)
    assert ref.documented_count == 0 and flex.documented_count == 0
    assert ref.forbidden_mass == 0 and flex.forbidden_mass == 0 and ts.missed_mass == 0
    assert sum(ref.weights) == pytest.approx(1.0) and sum(ts.weights) == pytest.approx(1.0)
    for column in (ref, ts, flex):  # Σ w·v is what each backend really produced, within the replay's tolerance
        assert column.reproduces, (column.backend, column.output_diff)
    text = "\n".join(text_of(AttentionText(p)))
    assert "4896" in text and f"{ts.forbidden_mass:.2e}" in text
    svg = svg_text(attention_drawing(p))
    assert "key 4896" in svg and f"{ts.forbidden_mass:.2e}" in svg


def test_dflash_default_is_the_worst_head_and_states_the_mass():
    res = run("attention", "--json")
    # flashinfer_ts weights keys outside the exact window: the documented page-aligned restriction, so the
    # snapshot's verdict (PASS, as replay says) with the weight on them stated
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["chosen"].startswith("the worst head of flashinfer_ts vs reference")
    ts = next(c for c in data["columns"] if c["backend"] == "flashinfer_ts")
    assert 4896 in [k["key"] for k in ts["forbidden_keys"]] and ts["forbidden_mass"] > 0
    assert ts["documented_mass"] == ts["forbidden_mass"] and ts["documented_count"] == ts["forbidden_count"]
    summary = data["verdict"]["summary"]
    assert summary.startswith("PASS") and f"{ts['forbidden_mass']:.2e} of its weight" in summary
    assert "shows by design (documented, not a failure)" in summary
    lines = run("attention").output.rstrip().splitlines()
    assert max(len(line) for line in lines) <= 80 and lines[-1].endswith("(exit 0)")


def test_prefix_page0_flex_gives_the_null_block_no_weight():
    p = api.attention(PAGE0)
    assert (p.step, p.request) == (1, 1) and p.null_block == [(32, 48)]
    flex, ref = p.column("flex"), p.column("reference")
    lo = p.span[0]
    assert all(flex.weights[k - lo] == 0 for k in range(32, 48))
    assert all(ref.weights[k - lo] > 0 for k in range(32, 48))
    assert flex.missed_count == 16 and sorted(k for k, _ in flex.missed_keys) == list(range(32, 48))
    assert flex.missed_mass == pytest.approx(sum(ref.weights[32 - lo:48 - lo]))
    assert flex.reproduces and ref.reproduces  # the weights give flex's wrong output, not the reference's
    assert flex.exact_output_diff > 10 * flex.output_diff
    assert p.stale_entries  # the fixture's stale table tails are marked
    svg = svg_text(attention_drawing(p))
    assert "null block (engine page 0) at keys 32..47" in svg


@pytest.mark.parametrize("feature", [dict(alibi_slopes="auto"), dict(alibi_slopes="auto", alibi_sqrt=True),
                                     dict(sinks="auto")], ids=["alibi", "alibi sqrt", "sinks"])
def test_the_weights_are_the_layers_own_with_alibi_and_sinks(tmp_path, feature):
    """The picture's logits once lacked the ALiBi bias and the sink term: every weight was wrong, and the
    reference's own column 'did not reproduce its output' (exit 1) on a snapshot whose replay passes."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    spec = SynthSpec(seq_lens=(40, 77), num_heads=4, num_kv_heads=1, engine_output="reference", **feature)
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "feature.safetensors"))
    assert CliRunner().invoke(cli, ["replay", path]).exit_code == 0
    p = api.attention(path)
    ref = p.column("reference")
    assert ref.reproduces and ref.output_diff <= ref.output_allowed
    total = sum(ref.weights)
    assert total == pytest.approx(1.0) if "sinks" not in feature else 0.0 < total < 1.0  # the sink takes a share
    assert run("attention", path).exit_code == 0


def test_attention_options_and_files(tmp_path):
    res = run("attention", PAGE0, "--step", "0", "--request", "0", "--head", "3", "--token", "0",
              "--png", tmp_path / "a.png", "--svg", tmp_path / "a.svg")
    # The snapshot's step 0 fails (flex hides request 1's keys); the token asked for is itself fine.
    assert res.exit_code == 1, res.output
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    out = " ".join(res.output.split())
    assert "FAIL: " in out and out.endswith("at request 0, head 3, token 0 of step 0: every column weights exactly "
                                            "the keys of the exact mask (exit 1)")
    res = run("attention", PAGE0, "--token", "5", "--request", "0", "--step", "0", "--head", "0")
    assert res.exit_code == 2 and res.output.strip() == (
        "Error: --token 5 is out of range: request 0 has 1 query token(s)")
    res = run("attention", PAGE0, "--head", "0-3")
    assert res.exit_code == 2 and "give one index" in res.output


# --------------------------------------------------------------------------- issue 44: NaN in a live K slot


def test_attention_draws_a_nan_key_and_never_passes(nan_k_snapshot, tmp_path):
    """Issue 44: one NaN in a K slot request 0 reads crashed `kvdbg attention` (with or without --svg/--png) in
    the renderer (ValueError: cannot convert float NaN to integer) and wrote no file. It draws now: the key is
    named, its weights show as N (text) and crossed-out dark bars (SVG/PNG), and the verdict fails."""
    from tests.nan_snapshot import NAN_KEY

    svg, png = tmp_path / "nan.svg", tmp_path / "nan.png"
    res = run("attention", nan_k_snapshot, "--svg", svg, "--png", png)
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    text = " ".join(res.output.split())
    # The default is the worst failing head: a head of KV head 0 in request 0, whose output is NaN.
    assert "step 0, request 0, head 0 (kv head 0)" in text
    assert f"NaN/Inf in K at key {NAN_KEY}: read by reference, flex (its weights are NaN)" in text
    assert "NaN, as its output" in text  # Σw·v is NaN, and so is the output each backend wrote
    assert any(set(line.split(maxsplit=1)[-1]) == {"N"} for line in lines if line.startswith("flex "))
    assert text.startswith("where the attention went") and " FAIL: " in text
    assert text.endswith(f"; at request 0, head 0, token 0 of step 0: reference attends key {NAN_KEY} whose K "
                         f"holds NaN/Inf: its weights are NaN; flex attends key {NAN_KEY} whose K holds NaN/Inf: its "
                         "weights are NaN (exit 1)")
    assert png.read_bytes()[:4] == b"\x89PNG"
    root = ET.parse(svg).getroot()
    svg_words = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert f"NaN/Inf in K at key {NAN_KEY}" in svg_words
    assert 'fill="#67000d"' in svg.read_text()  # the NaN bars, in the error map's NaN colour

    data = json.loads(run("attention", nan_k_snapshot, "--json").output)
    assert data["verdict"]["status"] == "fail" and data["nonfinite_k_keys"] == [[NAN_KEY, NAN_KEY + 1]]
    for column in data["columns"]:
        assert column["nonfinite_k_keys_read"] == [NAN_KEY] and column["nonfinite_k_count"] == 1
        assert all(w is None for w in column["weights"])  # NaN weights: null in strict JSON, never 0


def test_attention_on_a_head_that_does_not_read_the_nan_passes(nan_k_snapshot):
    """KV head 1 (query heads 4..7) holds no NaN: its picture is the clean one, and the NaN is not blamed on it.
    The verdict is still the snapshot's (a NaN in a live page fails it, as `kvdbg replay` says)."""
    res = run("attention", nan_k_snapshot, "--step", "0", "--request", "0", "--head", "4", "--token", "0")
    assert res.exit_code == 1, res.output
    assert "NaN" not in res.output and res.output.rstrip().endswith("(exit 1)")
    text = " ".join(res.output.split())
    assert "FAIL: " in text and "nonfinite_kv" in text
    assert text.endswith("at request 0, head 4, token 0 of step 0: every column weights exactly the keys of the "
                         "exact mask (exit 1)")
