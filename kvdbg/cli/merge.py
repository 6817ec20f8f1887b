"""`kvdbg merge RANK_FILES... -o OUT`."""

from __future__ import annotations

import click

from kvdbg.cli.common import AliasedOption, console, emit_json, force_option, guarded, json_option, output_option


@click.command()
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False))
@output_option("Where to write the merged snapshot.", required=True)
@click.option("--num-kv-heads", "--kv-heads", "kv_heads", cls=AliasedOption, hidden_aliases=("--kv-heads",),
              type=click.IntRange(min=1), default=None,
              help="The layer's KV heads over all ranks, for files that did not record it "
                   "(capture.total_num_kv_heads); needed only when each rank holds one KV head.")
@force_option()
@json_option
@guarded
def merge(snapshots, output, kv_heads, force, as_json):
    """Join the tensor-parallel ranks of one captured step into one snapshot of all heads.

    Give every rank's file of one layer's step (any order). Rank r's query
    heads follow rank r-1's; KV heads replicated over several ranks are
    stored once (and must hold the same bytes). Files that are not the same
    step (another layer, step, engine, batch, dtype, ...) are refused with the
    field named (exit 2). The result is written atomically and never replaces
    an existing file without --force, nor ever one of the inputs.

    \b
    Examples:
      kvdbg merge snaps/*layers.1.*-step5-rank*.safetensors -o step5.safetensors
      kvdbg replay step5.safetensors
    """
    from kvdbg.util.atomic import check_output
    from kvdbg.snapshot.merge import merge_ranks
    from kvdbg.snapshot.store import load_snapshot, save_snapshot

    check_output(output, overwrite=force, what="-o")  # never one of the files to merge, --force or not
    loaded = [load_snapshot(path) for path in dict.fromkeys(snapshots)]
    merged = merge_ranks(loaded, total_kv_heads=kv_heads)
    path = save_snapshot(merged, output, overwrite=force)
    layer, capture = merged.meta.layer, merged.meta.capture
    ranks = [share["tp_rank"] for share in capture["merged_from"]]
    if as_json:
        emit_json({"path": path, "layer": layer.name, "step": capture.get("step"), "tp_ranks": ranks,
                   "num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads,
                   "merged_from": capture["merged_from"]})
        return
    console().print(f"merged {len(ranks)} ranks of {layer.name} step {capture.get('step')}: "
                    f"{layer.num_heads} query heads, {layer.num_kv_heads} KV heads -> {path}")
