"""The Python API: the CLI's answers without the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvdbg
from kvdbg.errors import KvdbgError
from tests.helpers import FIXTURES, ROOT

DFLASH = f"{FIXTURES}/dflash.safetensors"
PAGE0 = f"{FIXTURES}/prefix_page0.safetensors"


def _cli_json(*args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "kvdbg", *args, "--json"], capture_output=True, text=True,
                          cwd=ROOT)
    return proc.returncode, json.loads(proc.stdout)


def test_import_kvdbg_does_not_import_torch():
    code = "import sys, kvdbg, kvdbg.api; kvdbg.replay, kvdbg.diff, kvdbg.sweep; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("path, backends", [(PAGE0, ["flex"]), (DFLASH, ["FLASHINFER_TS"])])
def test_replay_gives_the_clis_verdict_and_json(path, backends):
    report = kvdbg.replay(path, backends=backends)
    rc, cli = _cli_json("replay", path, *[a for b in backends for a in ("--backend", b)])
    assert report.verdict.exit_code == rc
    assert report.passed == (rc == 0) == cli["passed"]
    ours = report.to_json()
    assert ours["verdict"] == cli["verdict"]
    assert [f["code"] for f in ours["findings"]] == [f["code"] for f in cli["findings"]]
    assert [(c["actual"], c["expected"], c["passed"]) for c in ours["comparisons"]] == \
        [(c["actual"], c["expected"], c["passed"]) for c in cli["comparisons"]]


def test_replay_takes_a_loaded_snapshot_and_narrows_like_the_cli():
    snap = kvdbg.load_snapshot(PAGE0)
    report = kvdbg.replay(snap, backends=["flex"], requests=[0], heads=[0, 1])
    assert {h.request for c in report.comparisons for h in c.heads} == {0}
    assert {h.head for c in report.comparisons for h in c.heads} <= {0, 1}
    assert all(f.request in (None, 0) for f in report.findings)


@pytest.mark.parametrize("kwargs, field", [
    (dict(backends=["flexx"]), "--backend"),
    (dict(heads=[99]), "heads"),
    (dict(requests=[99]), "requests"),
])
def test_bad_arguments_raise_one_kvdbg_error_naming_the_field(kwargs, field):
    with pytest.raises(KvdbgError, match=field):
        kvdbg.replay(PAGE0, **kwargs)


def test_page_map_window_and_sweep_from_python():
    pm = kvdbg.page_map(PAGE0)
    assert {f.code for f in pm.anomalies} >= {"live_page_zero"}
    analysis = kvdbg.window(9000, 4096, query_len=8)
    assert analysis.to_json()["restriction"]
    result = kvdbg.sweep(PAGE0, "placement", backends=["flex"])
    assert [row.variant.name for row in result.rows][:1]
