"""`kvdbg import PATH`: what PATH is (a FlashInfer dump, or a flashinfer-bench dataset or workloads file), and
the one line that says why nothing was imported."""

from __future__ import annotations

import os
from pathlib import Path

from kvdbg.errors import OptionError
from kvdbg.importers.session import FLASHINFER_BENCH, REFUSED, ImportReport


def import_path(path: str | os.PathLike, *, kv_layout: str | None = None, workload: str | None = None,
                output: str | os.PathLike | None = None, overwrite: bool = False) -> ImportReport:
    """Import ``path``: a flashinfer-bench dataset (a directory holding ``definitions/``) or one of its
    ``.jsonl`` workload files; otherwise a FlashInfer dump directory (a session, or one call's directory)."""
    from kvdbg.importers.fibench.dataset import find_dataset

    found = find_dataset(path)
    if found is not None:
        if kv_layout is not None:
            raise OptionError("--kv-layout is for a FlashInfer dump without the wrapper's __init__; a "
                              "flashinfer-bench definition declares its layout (k_cache's shape)")
        from kvdbg.importers.fibench.importer import import_dataset

        root, only = found
        return import_dataset(root, only, workload=workload, output=output, overwrite=overwrite)
    if workload is not None:
        raise OptionError(f"--workload picks a flashinfer-bench workload, but {path} is not a flashinfer-bench "
                          "dataset (a directory holding definitions/ and workloads/) or one of its .jsonl files")
    given = Path(path)
    if given.exists() and not given.is_dir():
        raise OptionError(f"{path}: not a FlashInfer dump directory, nor a flashinfer-bench dataset or a .jsonl "
                          "workloads file inside one (no definitions/ directory above it)")
    from kvdbg.importers.session import import_session

    return import_session(path, kv_layout=kv_layout, output=output, overwrite=overwrite)


def nothing_imported(report: ImportReport, path: str | os.PathLike) -> str | None:
    """Why nothing was imported from ``path`` (the first refusal, or what was there), or None when something was."""
    if report.imported:
        return None
    refused = [item for item in report.items if item.status == REFUSED]
    if refused:
        first = refused[0]
        # a workload's reason names its file, line and uuid already; a call's is named by its directory
        what = first.reason if report.kind == FLASHINFER_BENCH else f"{first.call}: {first.reason}"
        return (f"nothing imported from {path}: {what}"
                + (f" (and {len(refused) - 1} more refused)" if len(refused) > 1 else ""))
    names = sorted({item.function for item in report.items})
    listed = f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}"
    if report.kind == FLASHINFER_BENCH:
        return (f"nothing imported from {path}: no workload of a paged GQA decode or prefill definition among its "
                f"{len(report.items)} workload(s) (definitions: {listed or 'none'})")
    return (f"nothing imported from {path}: no paged decode or prefill run among its {len(report.items)} call(s) "
            f"({listed})")
