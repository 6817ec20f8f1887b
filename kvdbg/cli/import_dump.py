"""`kvdbg import DUMP -o OUT`: FlashInfer's level-10 API dumps (FLASHINFER_LOGLEVEL=10) as kvdbg snapshots."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, force_option, guarded, json_option


@click.command(name="import")
@click.argument("dump", type=click.Path(file_okay=False))
@click.option("-o", "--output", "output", default=None, type=click.Path(), metavar="FILE",
              help="Where to write: a .safetensors FILE when the dump holds one paged-attention run, else a "
                   "directory (created) that gets one snapshot per run. Without -o nothing is written.")
@click.option("--kv-layout", type=click.Choice(["NHD", "HND"]), default=None,
              help="The wrappers' kv_layout, for a dump without their __init__ (it is never guessed).")
@force_option()
@json_option
@guarded
def import_dump(dump, output, kv_layout, force, as_json):
    """Turn a FlashInfer dump into kvdbg snapshots, one per paged-attention run.

    DUMP is FlashInfer's dump directory (FLASHINFER_DUMP_DIR, written with
    FLASHINFER_LOGLEVEL=10: SGLang and FlashInfer users have it) or one call's
    directory in it. Each run of BatchDecodeWithPagedKVCacheWrapper or
    BatchPrefillWithPagedKVCacheWrapper is read with its wrapper's __init__
    and plan (paired by the instance the records name), and each one-shot
    trtllm_batch_decode_with_kv_cache or trtllm_batch_context_with_kv_cache
    call: pages, NHD or HND layout, window, soft cap, scale, sinks, GQA, FP8
    scales, and the recorded output as the engine's output. Every other call
    is listed and skipped; what a snapshot cannot hold is refused by name.
    .pt files load only as plain tensors (torch.load weights_only=True).

    \b
    Examples:
      kvdbg import flashinfer_dumps                      (list, write nothing)
      kvdbg import flashinfer_dumps -o snaps/
      kvdbg import flashinfer_dumps/20260101_..._run_call0001 -o one.safetensors
      kvdbg replay snaps/
    """
    from kvdbg.importers.session import import_session
    from kvdbg.render.importing import render_import
    from kvdbg.errors import OptionError

    report = import_session(dump, kv_layout=kv_layout, output=output, overwrite=force)
    if not report.imported:
        refused = [item for item in report.items if item.status == "refused"]
        if refused:
            raise OptionError(f"nothing imported from {dump}: {refused[0].call}: {refused[0].reason}"
                              + (f" (and {len(refused) - 1} more refused)" if len(refused) > 1 else ""))
        functions = sorted({item.function for item in report.items})
        raise OptionError(f"nothing imported from {dump}: no paged decode or prefill run among its "
                          f"{len(report.items)} call(s) ({', '.join(functions[:6])}"
                          f"{', ...' if len(functions) > 6 else ''})")
    if as_json:
        emit_json({**report.to_json(), "written": output is not None})
    else:
        console().print(render_import(report, written=output is not None))
