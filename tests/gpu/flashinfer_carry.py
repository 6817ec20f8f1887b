"""Pack FlashInfer's wheel for the GPU machine (tests/gpu/prepare_flashinfer_carry.sh): what its paged decode and
prefill kernels need to JIT-build and run there, within the carry limit.

Writes ``flashinfer-<version>-py.zip`` into OUT: every Python file of the wheel, its metadata, and
``flashinfer/data`` less the subdirectories of ``data/csrc`` (the sources of kernel families these runs never
build); left out whole: ``flashinfer/moe_ep``, ``flashinfer/experimental/{b12x,cake_vsa_sm90_cute}`` and the other
kernel packages of LEFT_OUT (MoE, experimental and other families' kernels, 6.5 MB). The run script extracts it (the JIT compiler reads headers from disk).

Usage: python tests/gpu/flashinfer_carry.py WHEEL OUT [--engine]
"""

from __future__ import annotations

import os
import sys
import zipfile

LEFT_OUT = ("flashinfer/moe_ep/", "flashinfer/experimental/b12x/", "flashinfer/experimental/cake_vsa_sm90_cute/",
            # the wheel's top-level b12x shim, which imports flashinfer.experimental.b12x: vLLM imports b12x where
            # it finds it (vllm/utils/b12x.py), so the shim without its package would stop vLLM's model runner
            "b12x/",
            # Python kernels of other families that neither `import flashinfer` nor vLLM's FLASHINFER backend
            # imports (checked with python -X importtime), 1.5 MB: room for the engine's wheels beside this zip
            "flashinfer/cute_dsl/attention/", "flashinfer/cute_dsl/sparse/", "flashinfer/mla/_sparse_mla_sm120/",
            "flashinfer/msa_ops/cute_dsl/", "flashinfer/comm/mnnvl_cutedsl/", "flashinfer/diffusion_ops/",
            "flashinfer/attn_scores/kernels/", "flashinfer/fused_moe/cake/", "flashinfer/fused_moe/cake_cute/",
            "flashinfer/fused_moe/cutile/", "flashinfer/kda_kernels/tirx/", "flashinfer/experimental/cake_mxfp8_megamoe_ep16/",
            "flashinfer/experimental/cake_lm_head_loss/", "flashinfer/experimental/cake_dsa_train/",
            # data the JIT compiler never reads (CUTLASS's examples and Python packages, CCCL's Python), 2.3 MB
            "flashinfer/data/cutlass/examples/", "flashinfer/data/cutlass/python/", "flashinfer/data/cccl/python/")


def kept(name: str, left_out: tuple[str, ...] = LEFT_OUT) -> bool:
    if name.startswith(left_out):
        return False
    if ".dist-info/" in name:
        return name.endswith(("/METADATA", "/entry_points.txt", "/top_level.txt"))  # importlib.metadata's reads
    if name.endswith(".py"):
        return True
    if name.startswith("flashinfer/data/csrc/"):
        return "/" not in name[len("flashinfer/data/csrc/"):]  # the files of csrc itself, not its subfolders
    return name.startswith("flashinfer/data/")


# With --engine, also FlashInfer's prims_ts (FLASHINFER_TS's Blackwell kernel and its GEMMs, 1 MB): a whole engine
# on FLASHINFER never imports them, and the engine's wheels then fit beside this zip.
ENGINE_LEFT_OUT = ("flashinfer/attention/prims_ts/", "flashinfer/prims_ts/batched_gemm/", "flashinfer/prims_ts/moe/")


def main(argv: list[str]) -> int:
    engine = "--engine" in argv
    argv = [a for a in argv if a != "--engine"]
    wheel, out = argv
    left_out = LEFT_OUT + (ENGINE_LEFT_OUT if engine else ())
    os.makedirs(out, exist_ok=True)
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if not n.endswith("/")]
        version = next(n.split("/")[0][len("flashinfer_python-"):-len(".dist-info")] for n in names
                       if n.startswith("flashinfer_python-") and n.split("/")[0].endswith(".dist-info"))
        target = os.path.join(out, f"flashinfer-{version}-py.zip")
        packed = 0
        with zipfile.ZipFile(target + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
            for name in names:
                if kept(name, left_out):
                    dst.writestr(name, src.read(name))
                    packed += 1
    os.replace(target + ".tmp", target)
    print(f"{target}: {os.path.getsize(target) / 1e6:.1f} MB; {packed} of {len(names)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
