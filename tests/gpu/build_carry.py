"""Pack what tests/gpu/triton_attn_capture.py needs of vLLM onto a GPU machine without vLLM: its Python files.

Writes into OUT: ``vllm-<version>-py.zip`` (every ``.py`` file of the installed vLLM distribution and its
dist-info, so that ``importlib.metadata`` still finds it on PYTHONPATH) and ``vllm-so-modules.txt`` (the
names of its compiled modules, which are left behind and stubbed). Run with the Python whose vLLM is to be
carried (the vLLM 0.33 CUDA wheel, installed with --no-deps: tests/vllm033/run.sh builds such a venv).

Usage: python tests/gpu/build_carry.py --out .gpu-carry
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import zipfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist = importlib.metadata.distribution("vllm")
    files = [f for f in dist.files or [] if str(f).startswith(("vllm/", f"vllm-{dist.version}.dist-info/"))]
    os.makedirs(args.out, exist_ok=True)
    zip_path = os.path.join(args.out, f"vllm-{dist.version}-py.zip")
    compiled = []
    with zipfile.ZipFile(zip_path + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
        for f in sorted(files, key=str):
            name = str(f)
            if name.endswith(".so"):
                compiled.append(name.split(".", 1)[0].replace("/", "."))
            elif name.endswith(".py") or ".dist-info/" in name:
                out.write(f.locate(), name)
    os.replace(zip_path + ".tmp", zip_path)
    with open(os.path.join(args.out, "vllm-so-modules.txt"), "w") as f:
        f.write("".join(f"{name}\n" for name in sorted(compiled)))
    print(f"{zip_path}: {os.path.getsize(zip_path) / 1e6:.1f} MB; {len(compiled)} compiled modules listed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
