"""`kvdbg synth -o OUT`: write a deterministic synthetic snapshot."""

from __future__ import annotations

import click

from kvdbg.cli.common import (AliasedOption, BadInput, HiddenOutputArgument, backend_name, console, emit_json,
                              force_option, guarded, json_option, output_option)
from kvdbg.errors import KvdbgError, OptionError
from kvdbg.snapshot.format import ATTN_TYPES, LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.util.ranges import IntListParam

class HeadValuesParam(click.ParamType):
    """'auto' or comma-separated numbers, one per query head (the count is checked against --num-heads)."""

    name = "auto|numbers"

    def convert(self, value, param, ctx):
        if not isinstance(value, str) or value == "auto":
            return value
        try:
            return tuple(float(v) for v in value.split(","))
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor comma-separated numbers", param, ctx)


# --layout names -> the format's kv_layout strings (docs/snapshot-format.md).
LAYOUT_CHOICES = {"vllm": LAYOUT_VLLM, "kv-planes": LAYOUT_KV_PLANES}


def _kvdbg_backend(ctx, param, value):
    if value is None:
        return None
    try:
        return backend_name(value, "--engine-output")
    except KvdbgError as exc:
        raise BadInput(str(exc)) from None


@click.command()
@click.argument("out", cls=HiddenOutputArgument, required=False, type=click.Path(dir_okay=False))
@output_option("Where to write the snapshot (required).")
@click.option("--seq-len", "--seq-lens", "seq_lens", cls=AliasedOption, hidden_aliases=("--seq-lens",),
              type=IntListParam(), default="9,77,200,333", show_default=True, metavar="L[,L...]",
              help="Sequence length of each request at the first step (query included), comma-separated.")
@click.option("--query-len", type=IntListParam(), default="1", show_default=True, metavar="Q[,Q...]",
              help="Query tokens per request: one value for a uniform block, or one per request (ragged).")
# The old spelling of a ragged --query-len, kept for scripts (it wins over --query-len, as it did).
@click.option("--query-lens", type=IntListParam(), default=None, hidden=True)
@click.option("--num-heads", type=int, default=8, show_default=True, help="Query heads (Hq).")
@click.option("--num-kv-heads", type=int, default=2, show_default=True, help="KV heads (Hkv).")
@click.option("--head-size", "--head-dim", "head_size", cls=AliasedOption, hidden_aliases=("--head-dim",), type=int,
              default=64, show_default=True, help="Head size (D), as head_size in the metadata.")
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
              help="vllm: [pages, Hkv, page_size, 2*D], K|V rows per page and head (vLLM's packed "
                   "cache); kv-planes: [2, pages, page_size, Hkv, D], K and V planes (vLLM's "
                   "FlashAttention-style shape).")
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
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random number generator.")
@click.option("--num-gpu-blocks", type=int, default=None, help="Pages in the engine's cache (default: auto).")
@click.option("--max-model-len", type=int, default=None)
@click.option("--max-decode-query-len", type=int, default=None)
@click.option("--backend-name", default=None, help="Engine backend recorded in the metadata.")
@click.option("--notes", default="", help="Free text stored in the snapshot.")
@click.option("--engine-output", default=None, metavar="BACKEND", callback=_kvdbg_backend,
              help="Store each step's output computed by this kvdbg backend (reference, flex, flashinfer_ts) "
                   "as the engine's captured output.")
@click.option("--sinks", type=HeadValuesParam(), default=None, metavar="auto|V,V,...",
              help="Attention sinks: one logit per query head, or 'auto' (drawn from --seed).")
@click.option("--alibi", type=HeadValuesParam(), default=None, metavar="auto|S,S,...",
              help="ALiBi: one slope per query head, or 'auto' (ALiBi's geometric slopes).")
@click.option("--alibi-sqrt", is_flag=True, help="With --alibi: the square-root variant (TRITON_ATTN's use_alibi_sqrt).")
@click.option("--soft-cap", type=float, default=None, help="Logits soft cap: cap * tanh(s / cap) (default: none).")
@click.option("--attn-type", type=click.Choice(list(ATTN_TYPES)), default="decoder", show_default=True,
              help="encoder/encoder_only: self-attention over the step's own tokens (--mask dense, --seq-len equal "
                   "to the query lengths); encoder_decoder: decoder queries over seq_len encoder keys (--mask dense).")
@click.option("--kv-sharing-target", default=None, metavar="LAYER",
              help="The layer whose cache this layer reads (it writes none: give --no-new-kv).")
@click.option("--chunk-lookback", type=int, default=None,
              help="With --window: TRITON_ATTN's chunked attention, chunks of window // (N + 1) tokens.")
@force_option()
@json_option
@guarded
def synth(out, output, seq_lens, query_len, query_lens, num_heads, num_kv_heads, head_size, page_size, window, mask, dtype,
          fp8, fp8_storage, q_scale, k_scale, v_scale, layout, shuffle, shared_prefix_pages, use_page_zero,
          page_zero_request, stale_tail, steps, new_kv, seed, num_gpu_blocks, max_model_len,
          max_decode_query_len, backend_name, notes, engine_output, sinks, alibi, alibi_sqrt, soft_cap, attn_type,
          kv_sharing_target, chunk_lookback, force, as_json):
    """Write a deterministic synthetic snapshot: the same options give the same bytes.

    \b
    Examples:
      kvdbg synth -o causal.safetensors --seq-len 9,77,200,333 \\
        --num-heads 32 --num-kv-heads 8 --head-size 128
      kvdbg synth -o dflash.safetensors --seq-len 9000,1000 --query-len 8 \\
        --mask dense --window 4096
      kvdbg synth -o fp8.safetensors --fp8 --mask dense --query-len 4
      kvdbg synth -o gpt_oss.safetensors --sinks auto --window 128 \\
        --engine-output reference
    """
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    if out is not None and output is not None and out != output:
        raise OptionError(f"two output files ({out} and -o {output}): give one, with -o")
    out = output or out
    if out is None:
        raise OptionError("-o/--output: give the file to write, e.g. -o snapshot.safetensors")

    if query_lens is None and len(query_len) > 1:
        query_lens = query_len
    query_len = query_len[0] if len(query_len) == 1 else 1

    spec = SynthSpec(
        seq_lens=seq_lens,
        query_len=query_len,
        query_lens=query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
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
        sinks=sinks,
        alibi_slopes=alibi,
        alibi_sqrt=alibi_sqrt,
        logits_soft_cap=soft_cap,
        attn_type=attn_type,
        kv_sharing_target=kv_sharing_target,
        chunk_lookback=chunk_lookback,
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
