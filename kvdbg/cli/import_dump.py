"""`kvdbg import PATH -o OUT`: FlashInfer's level-10 API dumps (FLASHINFER_LOGLEVEL=10) and flashinfer-bench
datasets as kvdbg snapshots."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, force_option, guarded, json_option


@click.command(name="import")
@click.argument("path", type=click.Path())
@click.option("-o", "--output", "output", default=None, type=click.Path(), metavar="FILE",
              help="Where to write: a .safetensors FILE when PATH holds one paged-attention run or workload, "
                   "else a directory (created) that gets one snapshot each. Without -o nothing is written.")
@click.option("--kv-layout", type=click.Choice(["NHD", "HND"]), default=None,
              help="The wrappers' kv_layout, for a dump without their __init__ (it is never guessed).")
@click.option("--workload", default=None, metavar="UUID",
              help="A flashinfer-bench dataset: import only this workload (its uuid, or a prefix only it has).")
@force_option()
@json_option
@guarded
def import_dump(path, output, kv_layout, workload, force, as_json):
    """Turn a FlashInfer dump or a flashinfer-bench dataset into kvdbg snapshots.

    PATH is FlashInfer's dump directory (FLASHINFER_DUMP_DIR, written with
    FLASHINFER_LOGLEVEL=10: SGLang and FlashInfer users have it) or one call's
    directory in it. Each run of BatchDecodeWithPagedKVCacheWrapper or
    BatchPrefillWithPagedKVCacheWrapper is read with its wrapper's __init__
    and plan (paired by the instance the records name), and each one-shot
    trtllm_batch_decode_with_kv_cache or trtllm_batch_context_with_kv_cache
    call: pages, NHD or HND layout, window, soft cap, scale, sinks, GQA, FP8
    scales, and the recorded output as the engine's output. Every other call
    is listed and skipped; what a snapshot cannot hold is refused by name.
    .pt files load only as plain tensors (torch.load weights_only=True).

    PATH may instead be a flashinfer-bench dataset (a directory holding
    definitions/ and workloads/) or one workloads .jsonl file in it: each
    workload of a gqa_paged decode or prefill definition whose inputs are
    stored (safetensors) becomes a snapshot, without a captured output
    (flashinfer-bench records none); a workload with random inputs is
    refused, other definitions are skipped. Blobs are read only inside
    the dataset.

    \b
    Examples:
      kvdbg import flashinfer_dumps                      (list, write nothing)
      kvdbg import flashinfer_dumps -o snaps/
      kvdbg import flashinfer_dumps/20260101_..._run_call0001 -o one.safetensors
      kvdbg import flashinfer-trace -o snaps/            (flashinfer-bench)
      kvdbg replay snaps/
    """
    from kvdbg.errors import OptionError
    from kvdbg.importers.source import import_path, nothing_imported
    from kvdbg.render.importing import render_import

    report = import_path(path, kv_layout=kv_layout, workload=workload, output=output, overwrite=force)
    why = nothing_imported(report, path)
    if why is not None:
        raise OptionError(why)
    if as_json:
        emit_json({**report.to_json(), "written": output is not None})
    else:
        console().print(render_import(report, written=output is not None))
