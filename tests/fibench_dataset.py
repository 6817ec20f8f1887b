"""A small flashinfer-bench-shaped dataset, written by the tests from the public schema (flashinfer-bench's
docs/flashinfer-trace: Definition JSON, Workload/Trace JSONL, safetensors blobs under blob/workloads/).

``write_dataset(root)`` lays out::

    definitions/gqa_paged/<name>.json    three paged GQA definitions (decode ps16 with kv_last_page_len,
                                         decode ps1 without it, causal prefill ps16 whose kv_last_page_len is
                                         declared over len_indptr as some dataset definitions have it)
    definitions/rmsnorm/..., mla_paged/..., gqa_ragged/...   three that are not paged GQA
    workloads/<op_type>/<name>.jsonl     one line per workload
    blob/workloads/<op_type>/<name>/<name>_<uuid>.safetensors

and returns each workload's raw tensors, so that a test can compute, independently of kvdbg, what the
definition's semantics give (``expected_output``). The reference strings are short and written here; kvdbg
never runs them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

DECODE16 = "gqa_paged_decode_h8_kv2_d64_ps16"
DECODE1 = "gqa_paged_decode_h8_kv1_d32_ps1"
PREFILL16 = "gqa_paged_prefill_causal_h8_kv2_d64_ps16"
RMSNORM = "rmsnorm_h128"
MLA = "mla_paged_decode_h16_ckv512_kpe64_ps1"
RAGGED = "gqa_ragged_prefill_causal_h8_kv2_d64"

# Workload uuids (hex, as flashinfer-bench's uuid4 strings are).
DECODE_A, DECODE_B, DECODE_RANDOM = ("4f1c2a10-6b7e-4c55-9a0d-1e2f3a4b5c6d", "9b3e5d77-0c1a-4e8f-b2d4-6a7b8c9d0e1f",
                                     "c2d4e6f8-1a3b-4c5d-8e9f-0a1b2c3d4e5f")
DECODE_PS1 = "17a9c3e5-2b4d-4f60-8192-a3b4c5d6e7f8"
PREFILL_A = "e8f7d6c5-b4a3-4921-8f0e-d1c2b3a49586"
NORM_A, MLA_A, RAGGED_A = ("5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d", "6c7d8e9f-0a1b-4c2d-9e3f-4a5b6c7d8e9f",
                           "7e8f9a0b-1c2d-4e3f-a4b5-c6d7e8f9a0b1")

REFERENCE_NOTE = ("def run(*args):\n    # written for kvdbg's tests: the semantics are in the definition's "
                  "description\n    raise NotImplementedError\n")


def _axis(value: int | None = None) -> dict:
    return {"type": "var"} if value is None else {"type": "const", "value": value}


def _tensor(shape, dtype: str) -> dict:
    return {"shape": shape, "dtype": dtype}


def gqa_paged_definition(name: str, stage: str, heads: int, kv_heads: int, dim: int, page_size: int, *,
                         last_page: str | None, layout: str = "NHD") -> dict:
    tokens = "batch_size" if stage == "decode" else "total_q"
    cache = (["num_pages", "page_size", "num_kv_heads", "head_dim"] if layout == "NHD"
             else ["num_pages", "num_kv_heads", "page_size", "head_dim"])
    axes = {tokens: _axis(), "num_qo_heads": _axis(heads), "num_kv_heads": _axis(kv_heads), "head_dim": _axis(dim),
            "num_pages": _axis(), "page_size": _axis(page_size), "len_indptr": _axis(), "num_kv_indices": _axis()}
    if stage == "prefill":
        axes["batch_size"] = _axis()
    inputs = {"q": _tensor([tokens, "num_qo_heads", "head_dim"], "bfloat16"),
              "k_cache": _tensor(cache, "bfloat16"), "v_cache": _tensor(cache, "bfloat16")}
    if stage == "prefill":
        inputs["qo_indptr"] = _tensor(["len_indptr"], "int32")
    inputs["kv_indptr"] = _tensor(["len_indptr"], "int32")
    inputs["kv_indices"] = _tensor(["num_kv_indices"], "int32")
    if last_page == "batch":
        inputs["kv_last_page_len"] = _tensor(["batch_size"], "int32")
    elif last_page == "indptr":
        inputs["kv_last_page_len"] = _tensor(["len_indptr"], "int32")
    inputs["sm_scale"] = _tensor(None, "float32")
    return {
        "name": name, "op_type": "gqa_paged", "tags": [f"stage:{stage}", "status:verified"],
        "description": f"Paged GQA {stage} written for kvdbg's tests"
                       + (" (causal, bottom-right aligned)" if stage == "prefill" else ""),
        "axes": axes, "inputs": inputs,
        "outputs": {"output": _tensor([tokens, "num_qo_heads", "head_dim"], "bfloat16"),
                    "lse": _tensor([tokens, "num_qo_heads"], "float32")},
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
        "reference": REFERENCE_NOTE,
    }


OTHER_DEFINITIONS = {
    RMSNORM: ("rmsnorm", {"axes": {"batch_size": _axis(), "hidden_size": _axis(128)},
                          "inputs": {"input": _tensor(["batch_size", "hidden_size"], "bfloat16"),
                                     "weight": _tensor(["hidden_size"], "bfloat16"), "eps": _tensor(None, "float32")},
                          "outputs": {"output": _tensor(["batch_size", "hidden_size"], "bfloat16")}}),
    MLA: ("mla_paged", {"axes": {"batch_size": _axis(), "num_qo_heads": _axis(16)},
                        "inputs": {"q_nope": _tensor(["batch_size", "num_qo_heads"], "bfloat16")},
                        "outputs": {"output": _tensor(["batch_size", "num_qo_heads"], "bfloat16")}}),
    RAGGED: ("gqa_ragged", {"axes": {"total_q": _axis(), "num_qo_heads": _axis(8)},
                            "inputs": {"q": _tensor(["total_q", "num_qo_heads"], "bfloat16")},
                            "outputs": {"output": _tensor(["total_q", "num_qo_heads"], "bfloat16")}}),
}


@dataclass
class Workload:
    """One workload as written: its definition, uuid, raw tensors and scale, and the JSONL line's fields."""

    definition: str
    uuid: str
    stage: str
    tensors: dict[str, torch.Tensor]
    sm_scale: float
    page_size: int
    axes: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)


def _paged(seed: int, heads: int, kv_heads: int, dim: int, page_size: int, seq_lens: list[int],
           query_lens: list[int], num_pages: int, last_page: str | None, prefill: bool = False,
           page_zero: bool = False) -> dict[str, torch.Tensor]:
    """Raw inputs of one paged workload: pages drawn at random from ``num_pages`` (some left unused)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-length // page_size) for length in seq_lens]
    # Page 0 is a page like any other to FlashInfer, but vLLM's null block to kvdbg's flex column: it is used
    # only where a test asks for it.
    order = (torch.randperm(num_pages - 1, generator=gen) + 1)[:sum(pages_per)].to(torch.int32)
    if page_zero:
        order[-1] = 0
    indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0)), dtype=torch.int32)
    k = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_pages, page_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(torch.bfloat16)
    tensors = {"q": q, "k_cache": k, "v_cache": v, "kv_indptr": indptr, "kv_indices": order}
    if prefill:
        tensors["qo_indptr"] = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([length - (n - 1) * page_size for length, n in zip(seq_lens, pages_per)], dtype=torch.int32)
    if last_page == "batch":
        tensors["kv_last_page_len"] = last
    elif last_page == "indptr":  # padded with a 0 to len_indptr, as some dataset definitions declare it
        tensors["kv_last_page_len"] = torch.cat([last, torch.zeros(1, dtype=torch.int32)])
    return tensors


def blob_path(definition: str, op_type: str, uuid: str) -> str:
    return f"./blob/workloads/{op_type}/{definition}/{definition}_{uuid}.safetensors"


def _stored(root: Path, w: Workload, op_type: str, *, scale_as: str = "scalar", random: tuple[str, ...] = ()) -> None:
    """Write ``w``'s blob (every tensor not in ``random``) and fill its JSONL inputs."""
    rel = blob_path(w.definition, op_type, w.uuid)
    stored = {name: t.contiguous() for name, t in w.tensors.items() if name not in random}
    if scale_as == "safetensors":
        stored["sm_scale"] = torch.tensor(w.sm_scale, dtype=torch.float32)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(root / rel))
    for name in w.tensors:
        w.inputs[name] = {"type": "random"} if name in random else {"type": "safetensors", "path": rel,
                                                                    "tensor_key": name}
    w.inputs["sm_scale"] = ({"type": "scalar", "value": w.sm_scale} if scale_as == "scalar" else
                            {"type": "safetensors", "path": rel, "tensor_key": "sm_scale"})


def _axes(w: Workload, stage: str) -> dict:
    t = w.tensors
    axes = {"num_pages": t["k_cache"].shape[0], "len_indptr": t["kv_indptr"].numel(),
            "num_kv_indices": t["kv_indices"].numel()}
    axes["batch_size" if stage == "decode" else "total_q"] = t["q"].shape[0]
    if stage == "prefill":
        axes["batch_size"] = t["kv_indptr"].numel() - 1
    return axes


def write_dataset(root: Path) -> dict[str, Workload]:
    """The dataset under ``root``; its workloads by uuid."""
    root = Path(root)
    definitions = {
        DECODE16: gqa_paged_definition(DECODE16, "decode", 8, 2, 64, 16, last_page="batch"),
        DECODE1: gqa_paged_definition(DECODE1, "decode", 8, 1, 32, 1, last_page=None),
        PREFILL16: gqa_paged_definition(PREFILL16, "prefill", 8, 2, 64, 16, last_page="indptr"),
    }
    for name, definition in definitions.items():
        _write_json(root / "definitions" / "gqa_paged" / f"{name}.json", definition)
    for name, (op_type, body) in OTHER_DEFINITIONS.items():
        _write_json(root / "definitions" / op_type / f"{name}.json",
                    {"name": name, "op_type": op_type, "tags": ["status:verified"], "description": f"{op_type}",
                     "reference": REFERENCE_NOTE, **body})

    workloads = {
        DECODE_A: Workload(DECODE16, DECODE_A, "decode", _paged(1, 8, 2, 64, 16, [37, 16, 5], [1, 1, 1], 12, "batch"),
                           0.125, 16),
        DECODE_B: Workload(DECODE16, DECODE_B, "decode", _paged(2, 8, 2, 64, 16, [70], [1], 9, "batch", page_zero=True),
                           0.1, 16),
        DECODE_RANDOM: Workload(DECODE16, DECODE_RANDOM, "decode",
                                _paged(3, 8, 2, 64, 16, [20, 9], [1, 1], 4, "batch"), 0.125, 16),
        DECODE_PS1: Workload(DECODE1, DECODE_PS1, "decode", _paged(4, 8, 1, 32, 1, [9, 4], [1, 1], 20, None),
                             1 / math.sqrt(32), 1),
        PREFILL_A: Workload(PREFILL16, PREFILL_A, "prefill",
                            _paged(5, 8, 2, 64, 16, [20, 33, 7], [3, 1, 7], 10, "indptr", prefill=True), 0.125, 16),
    }
    for w in workloads.values():
        w.axes = _axes(w, w.stage)
    _stored(root, workloads[DECODE_A], "gqa_paged")
    _stored(root, workloads[DECODE_B], "gqa_paged")
    _stored(root, workloads[DECODE_RANDOM], "gqa_paged", random=("q", "k_cache", "v_cache"))
    _stored(root, workloads[DECODE_PS1], "gqa_paged", scale_as="safetensors")
    _stored(root, workloads[PREFILL_A], "gqa_paged")

    lines: dict[str, list[dict]] = {}
    for w in workloads.values():
        lines.setdefault(f"gqa_paged/{w.definition}", []).append(_line(w.definition, w.uuid, w.axes, w.inputs))
    lines[f"rmsnorm/{RMSNORM}"] = [_line(RMSNORM, NORM_A, {"batch_size": 4},
                                         {"input": {"type": "random"}, "weight": {"type": "random"},
                                          "eps": {"type": "scalar", "value": 1e-6}})]
    lines[f"mla_paged/{MLA}"] = [_line(MLA, MLA_A, {"batch_size": 2}, {"q_nope": {"type": "random"}})]
    lines[f"gqa_ragged/{RAGGED}"] = [_line(RAGGED, RAGGED_A, {"total_q": 5}, {"q": {"type": "random"}})]
    for rel, records in lines.items():
        path = root / "workloads" / f"{rel}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return workloads


def _line(definition: str, uuid: str, axes: dict, inputs: dict) -> dict:
    return {"definition": definition, "workload": {"uuid": uuid, "axes": axes, "inputs": inputs},
            "solution": None, "evaluation": None}


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def edit_workload(root: Path, uuid: str, change) -> None:
    """Rewrite the JSONL line of workload ``uuid``: ``change(record)`` edits the parsed line in place."""
    for path in (Path(root) / "workloads").rglob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any(r["workload"]["uuid"] == uuid for r in records):
            for r in records:
                if r["workload"]["uuid"] == uuid:
                    change(r)
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            return
    raise KeyError(uuid)


def rewrite_blob(root: Path, w: Workload, **replace: torch.Tensor) -> None:
    """Write ``w``'s blob again with some tensors replaced (the JSONL line unchanged)."""
    path = Path(root) / blob_path(w.definition, "gqa_paged", w.uuid)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    tensors.update({k: v.contiguous() for k, v in replace.items()})
    save_file(tensors, str(path))


def expected_output(w: Workload) -> torch.Tensor:
    """What the definition computes for ``w``, in float64, read from the workload's own tensors (no kvdbg code):
    request r's keys are its pages in order, the last one cut to kv_last_page_len (every page full without it);
    decode: the one query sees every key; prefill: query i of q sees keys 0 .. L - q + i."""
    t = w.tensors
    q, k, v = (t[name].double() for name in ("q", "k_cache", "v_cache"))
    indptr, indices = t["kv_indptr"].tolist(), t["kv_indices"].long()
    batch = len(indptr) - 1
    qo = t["qo_indptr"].tolist() if "qo_indptr" in t else list(range(batch + 1))
    group = q.shape[1] // k.shape[2]
    out = torch.zeros_like(q)
    for r in range(batch):
        pages = indices[indptr[r]:indptr[r + 1]]
        keys = k[pages].reshape(-1, k.shape[2], k.shape[3])
        values = v[pages].reshape(-1, v.shape[2], v.shape[3])
        length = keys.shape[0]
        if "kv_last_page_len" in t:
            length = (pages.numel() - 1) * w.page_size + int(t["kv_last_page_len"][r])
        keys, values = keys[:length], values[:length]
        count = qo[r + 1] - qo[r]
        for i in range(count):
            visible = length - count + i + 1
            for h in range(q.shape[1]):
                scores = keys[:visible, h // group] @ q[qo[r] + i, h] * w.sm_scale
                out[qo[r] + i, h] = torch.softmax(scores, 0) @ values[:visible, h // group]
    return out
