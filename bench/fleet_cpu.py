"""Files per second of `kvdbg replay DIR` over 1,000 small snapshots: --jobs 1, --jobs 2, and Ray with 2 workers.

Every run is the command a user types (``python -m kvdbg replay DIR --results
FILE --json``, the default backends), in a child process, over the same
directory, one after the other in this one invocation; the figures to compare
are the ratios. Two rates per run:

- *files/s*: files / wall time of the command (start-up, workers importing
  torch, the Ray driver joining the cluster, the summary included);
- *steady/s*: files finished from the 10th row to the last / the time between
  them, from the results file's ``finished`` stamps (start-up left out).

Ray runs on a cluster of this machine started here (tests/fleet_ray/cluster.py:
a head with no CPU for tasks and two worker nodes of one CPU each, on
127.0.0.1), stopped at the end. Needs ``pip install -e '.[ray]'``; ``--no-ray``
leaves it out. The snapshots are made once in ``--dir`` (kept for the next run).

    python bench/fleet_cpu.py [--files 1000] [--dir /tmp/kvdbg-fleet-small] [--no-ray]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fleet import REPO, link_into, make_small, run, table  # noqa: E402

sys.path.insert(0, REPO)  # tests.fleet_ray.cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "kvdbg-fleet-small"))
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    made = make_small(args.dir, args.files)
    work = tempfile.mkdtemp(prefix="kvdbg-fleet-")
    directory = os.path.join(work, "files")  # exactly --files of them, whatever else --dir holds
    link_into(directory, made)
    size = sum(os.path.getsize(p) for p in made)
    print(f"{args.files} snapshots of {size / args.files / 1024:.0f} KiB (made or found in "
          f"{time.perf_counter() - t0:.1f} s); {os.cpu_count()} CPU(s)")
    runs = [run("jobs 1", directory, ["--jobs", "1"], work), run("jobs 2", directory, ["--jobs", "2"], work)]
    if not args.no_ray:
        from tests.fleet_ray.cluster import LocalCluster

        t1 = time.perf_counter()
        with LocalCluster(workers=2, cpus=1) as cluster:
            print(f"Ray cluster (head + 2 worker nodes of 1 CPU) up in {time.perf_counter() - t1:.1f} s")
            runs.append(run("ray 2 workers", directory, ["--ray", cluster.address], work))
    table(runs, runs[0])
    for r in runs:
        print(f"{r['label']}: " + ", ".join(f"{d['device']} {d['files']} files ({d['workers']} worker"
                                          f"{'s' if d['workers'] > 1 else ''})" for d in r["devices"]))
    same = all(r["verdicts"] == runs[0]["verdicts"] for r in runs)
    print(f"same verdict for every file in every run: {same}")


if __name__ == "__main__":
    main()
