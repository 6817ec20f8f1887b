"""Install kvdbg into the engine's venv the way the README says, and fail if anything else there changes.

The README's capture section says: install kvdbg into the environment where
the engine runs, with no extra (``pip install -e .``); nothing else of that
environment changes. This script holds the engine stage to it:

1. kvdbg is uninstalled, and every installed distribution's name and version
   recorded;
2. ``pip install --dry-run --report`` of the README's command must plan to
   install kvdbg alone;
3. the README's command runs (with its dependencies, no ``--no-deps``), unless
   the dry run already planned anything else;
4. every distribution but kvdbg must have the same name and version as before.

Usage (from the repository root): ``python -m tests.engine.install_check VENV [REPORT]``.
Exit 0 when the environment is unchanged, 1 with the differences otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# What the README tells a user to run inside the engine's environment (the repository root is the cwd).
README_INSTALL = ["install", "-e", "."]
OWN = "kvdbg"


def _pip(venv: str, *args: str, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", *args], check=False, text=True,
                          capture_output=capture, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def installed(venv: str) -> dict[str, str]:
    """Every distribution installed in ``venv`` (normalised name -> version), kvdbg left out."""
    done = _pip(venv, "list", "--format=json")
    if done.returncode != 0:
        raise SystemExit(f"pip list failed: {done.stderr.strip()[-500:]}")
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(done.stdout)
            if d["name"].lower() != OWN}


def planned(venv: str) -> list[str]:
    """Distributions pip's dry run of the README's command would install, as ``name==version``."""
    done = _pip(venv, *README_INSTALL[:1], "--dry-run", "--quiet", "--report", "-", *README_INSTALL[1:])
    if done.returncode != 0:
        raise SystemExit(f"pip install --dry-run failed: {done.stderr.strip()[-500:]}")
    report = json.loads(done.stdout)
    return [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report.get("install", [])]


def main(argv: list[str]) -> int:
    venv = argv[0]
    report_path = argv[1] if len(argv) > 1 else None
    _pip(venv, "uninstall", "-y", "-q", OWN)
    before = installed(venv)
    plan = planned(venv)
    others = [p for p in plan if p.split("==")[0].lower() != OWN]
    if others:  # the dry run already says the README's command would change the engine: do not run it
        after = before
    else:
        done = _pip(venv, *README_INSTALL, "-q")
        if done.returncode != 0:
            raise SystemExit(f"pip {' '.join(README_INSTALL)} failed: {done.stderr.strip()[-500:]}")
        after = installed(venv)
    changed = sorted(
        f"{name}: {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
        for name in set(before) | set(after) if before.get(name) != after.get(name)
    )
    lines = [
        f"engine venv {venv}: {len(before)} distributions besides kvdbg",
        f"pip install --dry-run {' '.join(README_INSTALL[1:])} would install: {', '.join(plan) or 'nothing'}",
        (f"not run: the dry run plans {len(others)} distribution(s) besides kvdbg" if others else
         f"after pip {' '.join(README_INSTALL)}: "
         + (f"{len(changed)} other distribution(s) changed" if changed else "no other distribution changed")),
        *[f"  {c}" for c in changed],
    ]
    ok = not others and not changed and any(p.split("==")[0].lower() == OWN for p in plan)
    lines.append("install check: " + ("PASS" if ok else "FAIL"))
    text = "\n".join(lines)
    print(text)
    if report_path:
        os.makedirs(os.path.dirname(report_path) or ".", exist_ok=True)
        with open(report_path, "w") as fh:
            fh.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
