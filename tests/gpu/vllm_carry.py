"""Pack a vLLM wheel's Python files for a GPU machine without vLLM (tests/gpu/prepare_vllm_column_carry.sh).

Writes into OUT ``vllm-<version>-py.zip`` (every ``.py`` file of the wheel and its dist-info, so that
``importlib.metadata`` finds vLLM on PYTHONPATH: its platform detection reads the version) and
``vllm-so-modules.txt`` (the compiled modules, left behind; the test harness stubs them).

Usage: python tests/gpu/vllm_carry.py WHEEL OUT
"""

from __future__ import annotations

import os
import sys
import zipfile


def main(argv: list[str]) -> int:
    wheel, out = argv
    os.makedirs(out, exist_ok=True)
    compiled, version = [], None
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        version = next(n.split("/")[0][len("vllm-"):-len(".dist-info")] for n in names
                       if n.startswith("vllm-") and n.split("/")[0].endswith(".dist-info"))
        target = os.path.join(out, f"vllm-{version}-py.zip")
        with zipfile.ZipFile(target + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
            for name in names:
                if name.endswith(".so"):
                    compiled.append(name.split(".", 1)[0].replace("/", "."))
                elif (name.startswith("vllm/") and name.endswith(".py")) or ".dist-info/" in name:
                    dst.writestr(name, src.read(name))
    os.replace(target + ".tmp", target)
    with open(os.path.join(out, "vllm-so-modules.txt"), "w") as fh:
        fh.write("".join(f"{name}\n" for name in sorted(compiled)))
    print(f"{target}: {os.path.getsize(target) / 1e6:.1f} MB; {len(compiled)} compiled modules listed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
