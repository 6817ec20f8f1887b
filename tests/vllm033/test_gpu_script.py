"""tests/gpu/triton_attn_capture.py (run on a GPU by the lead) works here, with torch stand-ins for the two kernels.

What this holds on a CPU: the carried zip of vLLM's Python files imports the op modules once vLLM's
compiled modules are stubbed (and its dist-info is found in the zip); the script's allocation, capture,
read-back, replay and both mis-declared-layout checks pass. vLLM's Triton kernels themselves run only on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from tests.helpers import ROOT


def test_the_gpu_script_runs_from_the_carried_zip_with_standin_kernels(tmp_path):
    carry = tmp_path / "carry"
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "build_carry.py"), "--out", str(carry)],
                   check=True, capture_output=True, text=True)
    (zip_path,) = carry.glob("vllm-*-py.zip")
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
    assert "vllm/v1/attention/ops/triton_unified_attention.py" in names
    assert not any(n.endswith(".so") for n in names) and any(".dist-info/METADATA" in n for n in names)
    so_modules = (carry / "vllm-so-modules.txt").read_text().split()
    assert "vllm._C_stable_libtorch" in so_modules

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(zip_path), ROOT]), VLLM_CONFIGURE_LOGGING="0")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "triton_attn_capture.py"),
                           "--so-modules", str(carry / "vllm-so-modules.txt"), "--out", str(tmp_path / "out"),
                           "--standin-kernels", "--quick"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "vLLM"))]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[0].startswith(f"vLLM 0.33.0 ops from {zip_path}"), lines
    assert [line.split(":")[1].split(",")[0].strip() for line in lines[1:]] == [
        "captured vs reference", "mis-declared layout fails", "all checks"], lines
    assert all(line.startswith("PASS STAND-IN KERNELS") for line in lines[1:]), lines
