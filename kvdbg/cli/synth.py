"""`kvdbg synth OUT`: write a deterministic synthetic snapshot."""

from __future__ import annotations

import click

from kvdbg.cli.common import console, emit_json, guarded, json_option
from kvdbg.ranges import IntListParam

LAYOUT_CHOICES = {"vllm": "pages,heads,tokens,2*dim", "seed": "2,pages,tokens,heads,dim"}


@click.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--seq-lens", type=IntListParam(), default="9,77,200,333", show_default=True,
              help="Comma-separated sequence length of each request at the first step (query included).")
@click.option("--query-len", type=int, default=1, show_default=True, help="Query tokens per request (uniform block).")
@click.option("--query-lens", type=IntListParam(), default=None,
              help="Comma-separated ragged query lengths (overrides --query-len).")
@click.option("--num-heads", type=int, default=8, show_default=True, help="Query heads (Hq).")
@click.option("--num-kv-heads", type=int, default=2, show_default=True, help="KV heads (Hkv).")
@click.option("--head-dim", type=int, default=64, show_default=True)
@click.option("--page-size", type=int, default=16, show_default=True)
@click.option("--window", type=int, default=None, help="Sliding window in tokens (default: none).")
@click.option("--mask", type=click.Choice(["causal", "dense"]), default="causal", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--fp8", is_flag=True, help="FP8 e4m3 KV cache (and query) with q/k/v scales.")
@click.option("--fp8-storage", type=click.Choice(["uint8", "float8_e4m3fn"]), default="uint8", show_default=True)
@click.option("--q-scale", type=float, default=None, help="Query scale (default 1, or 0.05 with --fp8).")
@click.option("--k-scale", type=float, default=None, help="Key scale (default 1, or 0.03 with --fp8).")
@click.option("--v-scale", type=float, default=None, help="Value scale (default 1, or 0.04 with --fp8).")
@click.option("--layout", type=click.Choice(sorted(LAYOUT_CHOICES)), default="vllm", show_default=True,
              help="vllm: [pages, Hkv, page_size, 2*D]; seed: [2, pages, page_size, Hkv, D].")
@click.option("--shuffle/--no-shuffle", default=True, show_default=True, help="Scatter physical page ids.")
@click.option("--shared-prefix-pages", type=int, default=0, show_default=True,
              help="Leading pages shared by every request (prefix caching).")
@click.option("--use-page-zero", is_flag=True, help="Give one request physical page 0 (vLLM's null block).")
@click.option("--page-zero-request", type=int, default=None, help="Which request gets page 0 (default 1).")
@click.option("--stale-tail", type=int, default=0, show_default=True,
              help="Extra block-table columns holding stale non-zero page ids.")
@click.option("--steps", type=int, default=1, show_default=True, help="Decode steps (each appends the query block).")
@click.option("--new-kv/--no-new-kv", default=True, show_default=True,
              help="Store each step's new K/V + slot_mapping (written into the cache before attention).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--num-gpu-blocks", type=int, default=None, help="Pages in the engine's cache (default: auto).")
@click.option("--max-model-len", type=int, default=None)
@click.option("--max-decode-query-len", type=int, default=None)
@click.option("--backend-name", default=None, help="Engine backend recorded in the metadata.")
@click.option("--notes", default="", help="Free text stored in the snapshot.")
@click.option("--engine-output", default=None, metavar="BACKEND",
              help="Store each step's output computed by this kvdbg backend (reference, flex, flashinfer_ts) "
                   "as the engine's captured output.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@json_option
@guarded
def synth(out, seq_lens, query_len, query_lens, num_heads, num_kv_heads, head_dim, page_size, window, mask, dtype,
          fp8, fp8_storage, q_scale, k_scale, v_scale, layout, shuffle, shared_prefix_pages, use_page_zero,
          page_zero_request, stale_tail, steps, new_kv, seed, num_gpu_blocks, max_model_len,
          max_decode_query_len, backend_name, notes, engine_output, force, as_json):
    """Write a deterministic synthetic snapshot to OUT (same options and seed: same bytes).

    \b
    Examples:
      kvdbg synth causal.safetensors --seq-lens 9,77,200,333 --num-heads 32 --num-kv-heads 8 --head-dim 128
      kvdbg synth dflash.safetensors --seq-lens 9000,1000 --query-len 8 --mask dense --window 4096
      kvdbg synth fp8.safetensors --fp8 --mask dense --query-len 4
    """
    from kvdbg.snapshot import save_snapshot
    from kvdbg.synth import SynthSpec, synth_snapshot

    spec = SynthSpec(
        seq_lens=seq_lens,
        query_len=query_len,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_dim,
        page_size=page_size,
        sliding_window=window,
        causal=mask == "causal",
        dtype=dtype,
        fp8=fp8,
        fp8_storage=fp8_storage,
        q_scale=q_scale if q_scale is not None else (0.05 if fp8 else 1.0),
        k_scale=k_scale if k_scale is not None else (0.03 if fp8 else 1.0),
        v_scale=v_scale if v_scale is not None else (0.04 if fp8 else 1.0),
        layout=LAYOUT_CHOICES[layout],
        shuffle=shuffle,
        shared_prefix_pages=shared_prefix_pages,
        use_page_zero=use_page_zero,
        page_zero_request=page_zero_request,
        stale_tail=stale_tail,
        steps=steps,
        new_kv=new_kv,
        seed=seed,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        max_decode_query_len=max_decode_query_len,
        backend=backend_name,
        notes=notes,
        engine_output=engine_output,
    )
    snap = synth_snapshot(spec)
    path = save_snapshot(snap, out, overwrite=force)
    import os

    result = {"path": path, "bytes": os.path.getsize(path), "stored_pages": snap.num_pages,
              "steps": snap.meta.num_steps, "requests": snap.steps[0].num_reqs}
    if as_json:
        emit_json(result)
    else:
        console(stderr=True).print(
            f"wrote {path}: {result['bytes']} bytes, {result['stored_pages']} stored pages, "
            f"{result['requests']} requests, {result['steps']} step(s)"
        )
