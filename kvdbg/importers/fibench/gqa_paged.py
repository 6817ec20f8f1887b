"""One workload of a flashinfer-bench paged GQA decode or prefill definition as FlashInfer's paged call
(:class:`kvdbg.importers.flashinfer_paged.PagedCall`), which that module turns into a snapshot.

What such a definition means is the paged GQA op of FlashInfer's trace templates (``gqa_paged_decode`` and
``gqa_paged_prefill`` in ``flashinfer/trace/templates/attention.py``, which wrap the paged decode and prefill
wrappers' ``run``) and of the flashinfer-trace dataset's ``gqa_paged`` definitions:

- ``op_type`` ``gqa_paged`` (an early form: ``type`` ``gqa`` and a name starting ``gqa_paged``); the stage is
  the name's ``gqa_paged_decode`` / ``gqa_paged_prefill``, else a ``stage:decode`` / ``stage:prefill`` tag;
- const axes ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``page_size`` (GQA: query head h reads KV head
  ``h // (num_qo_heads // num_kv_heads)``);
- inputs ``q`` [tokens, num_qo_heads, head_dim], ``k_cache`` and ``v_cache`` [pages, page_size, num_kv_heads,
  head_dim] (the layout is read from the names of these axes, never from a shape), ``kv_indptr`` and
  ``kv_indices`` (request r's pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``), ``sm_scale``; prefill adds
  ``qo_indptr``; some definitions add ``kv_last_page_len`` (the tokens of each request's last page; without it
  every page is full, as the template's reference flattens whole pages);
- decode: one query per request, which sees every key; prefill: causal, bottom-right aligned (query i of a
  request with q queries and L keys sees keys ``0 .. L - q + i``), as every published reference masks.

A definition that names any other input, another layout, or says it is not causal is refused, naming what; a
workload whose tensors are ``random`` is refused (flashinfer-bench draws them when it runs: they were never
recorded). No definition's reference code is run: its hash goes into the provenance.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from kvdbg.importers.fibench.dataset import MAX_AXIS, Dataset, DatasetError, Definition, WorkloadLine, read_tensor
from kvdbg.importers.flashinfer_paged import PagedCall

DECODE, PREFILL = "decode", "prefill"
LAST_PAGE_INPUTS = ("kv_last_page_len", "last_page_len")  # the dataset's name, and an early one
INPUTS = {DECODE: ("q", "k_cache", "v_cache", "kv_indptr", "kv_indices", "sm_scale", *LAST_PAGE_INPUTS),
          PREFILL: ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "sm_scale", *LAST_PAGE_INPUTS)}
REQUIRED = {DECODE: ("q", "k_cache", "v_cache", "kv_indptr", "kv_indices", "sm_scale"),
            PREFILL: ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "sm_scale")}
CONST_AXES = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
NOT_CAUSAL_WORDS = ("non-causal", "noncausal", "non_causal", "not causal", "bidirectional")
ATTENTION_WORDS = ("gqa", "mha", "mla", "dsa", "attention", "attn")


@dataclass(frozen=True)
class PagedDefinition:
    """A paged GQA definition, checked: what a workload of it is read with."""

    name: str
    where: str  # its file, relative to the dataset root
    stage: str  # decode | prefill
    kv_layout: str  # NHD | HND
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    last_page_input: str | None
    axes: dict[str, int | None]  # const axes their value, var axes None
    inputs: dict[str, tuple[list[str] | None, str]]  # name -> (shape as axis names | None for a scalar, dtype)
    provenance: dict[str, Any]


def _op_type(data: dict) -> str:
    value = data.get("op_type", data.get("type"))
    return value if isinstance(value, str) else ""


def _stage(name: str, tags: Any) -> str | None:
    for stage in (DECODE, PREFILL):
        if name.startswith(f"gqa_paged_{stage}"):
            return stage
    stages = {str(t).replace(" ", "").removeprefix("stage:") for t in tags if str(t).replace(" ", "").startswith(
        "stage:")} if isinstance(tags, list) else set()
    return stages.pop() if len(stages) == 1 and stages <= {DECODE, PREFILL} else None


def classify(definition: Definition) -> str | None:
    """``None`` when ``definition`` is a paged GQA definition (then :func:`read_definition` reads or refuses it),
    else why its workloads are skipped."""
    op_type, name = _op_type(definition.data), definition.name
    if op_type == "gqa_paged" or (op_type == "gqa" and name.startswith("gqa_paged")):
        return None
    if any(word in op_type.lower() or word in name.lower() for word in ATTENTION_WORDS):
        return f"op_type {op_type or '?'}: attention, but not paged GQA (gqa_paged) decode or prefill"
    return f"op_type {op_type or '?'}: not attention"


def _where(definition: Definition, field: str) -> str:
    return f"{definition.where}: {field}"


def read_definition(definition: Definition) -> PagedDefinition:
    """``definition`` (a paged GQA one) checked field by field; every refusal names the field."""
    data, name = definition.data, definition.name
    stage = _stage(name, data.get("tags"))
    if stage is None:
        raise DatasetError(_where(definition, f"{name} is gqa_paged, but neither its name (gqa_paged_decode_..., "
                                             "gqa_paged_prefill_...) nor a stage: tag says decode or prefill"))
    text = " ".join(str(data.get(k, "")) for k in ("name", "description")).lower() + " " + " ".join(
        str(t) for t in data.get("tags", []) if isinstance(data.get("tags"), list)).lower()
    if stage == PREFILL and any(word in text for word in NOT_CAUSAL_WORDS):
        raise DatasetError(_where(definition, "a prefill definition that says it is not causal: a gqa_paged "
                                              "prefill is causal, and another mask is not guessed"))

    axes_raw = data.get("axes")
    if not isinstance(axes_raw, dict):
        raise DatasetError(_where(definition, "axes is missing or not an object"))
    axes: dict[str, int | None] = {}
    for axis, spec in axes_raw.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "var":
            axes[axis] = None
        elif kind == "const":
            value = spec.get("value")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_AXIS:
                raise DatasetError(_where(definition, f"axes.{axis}.value must be an integer in [0, {MAX_AXIS}], got "
                                                      f"{repr(value)[:40]}"))
            axes[axis] = value
        else:
            raise DatasetError(_where(definition, f"axes.{axis} must be an object with type const or var"))
    for axis in CONST_AXES:
        if axes.get(axis) is None:
            raise DatasetError(_where(definition, f"axes.{axis} must be a const axis (every gqa_paged definition "
                                                  "fixes the heads, head_dim and page_size)"))
    if axes["num_qo_heads"] < 1 or axes["num_kv_heads"] < 1 or axes["head_dim"] < 1 or axes["page_size"] < 1:
        raise DatasetError(_where(definition, "axes num_qo_heads, num_kv_heads, head_dim and page_size must be "
                                              "at least 1"))

    inputs_raw = data.get("inputs")
    if not isinstance(inputs_raw, dict):
        raise DatasetError(_where(definition, "inputs is missing or not an object"))
    inputs: dict[str, tuple[list[str] | None, str]] = {}
    for input_name, spec in inputs_raw.items():
        if input_name not in INPUTS[stage]:
            raise DatasetError(_where(definition, f"input {input_name!r} is not one kvdbg reads in a gqa_paged "
                                                  f"{stage} definition ({', '.join(INPUTS[stage])}); what it means "
                                                  "is not guessed"))
        if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str):
            raise DatasetError(_where(definition, f"inputs.{input_name} must be an object with a dtype"))
        shape = spec.get("shape")
        if shape is not None and (not isinstance(shape, list) or not all(isinstance(a, str) and a in axes
                                                                          for a in shape)):
            raise DatasetError(_where(definition, f"inputs.{input_name}.shape must be null or a list of the "
                                                  f"definition's axes, got {repr(shape)[:60]}"))
        inputs[input_name] = (shape, spec["dtype"])
    for input_name in REQUIRED[stage]:
        if input_name not in inputs:
            raise DatasetError(_where(definition, f"input {input_name} is missing (a gqa_paged {stage} definition "
                                                  f"has {', '.join(REQUIRED[stage])})"))
    last = [n for n in LAST_PAGE_INPUTS if n in inputs]
    if len(last) > 1:
        raise DatasetError(_where(definition, "inputs kv_last_page_len and last_page_len both given"))

    def shape_of(input_name: str, rank: int) -> list[str]:
        shape = inputs[input_name][0]
        if shape is None or len(shape) != rank:
            raise DatasetError(_where(definition, f"inputs.{input_name}.shape must have {rank} axes, got "
                                                  f"{shape}"))
        return shape

    q_shape = shape_of("q", 3)
    if q_shape[1:] != ["num_qo_heads", "head_dim"] or axes[q_shape[0]] is not None:
        raise DatasetError(_where(definition, f"inputs.q.shape {q_shape} is not [tokens, num_qo_heads, head_dim] "
                                              "(tokens a var axis)"))
    k_shape = shape_of("k_cache", 4)
    if shape_of("v_cache", 4) != k_shape:
        raise DatasetError(_where(definition, f"inputs.v_cache.shape {inputs['v_cache'][0]} differs from "
                                              f"inputs.k_cache.shape {k_shape}"))
    if k_shape[1:] == ["page_size", "num_kv_heads", "head_dim"]:
        kv_layout = "NHD"
    elif k_shape[1:] == ["num_kv_heads", "page_size", "head_dim"]:
        kv_layout = "HND"
    else:
        raise DatasetError(_where(definition, f"inputs.k_cache.shape {k_shape} is neither [pages, page_size, "
                                              "num_kv_heads, head_dim] (NHD) nor [pages, num_kv_heads, page_size, "
                                              "head_dim] (HND)"))
    if k_shape[0] in CONST_AXES:
        raise DatasetError(_where(definition, f"inputs.k_cache.shape's first axis {k_shape[0]} must count pages"))
    for input_name in ("kv_indptr", "kv_indices", "qo_indptr", *last):
        if input_name in inputs:
            shape_of(input_name, 1)
            if inputs[input_name][1] not in INDEX_DTYPES:
                raise DatasetError(_where(definition, f"inputs.{input_name}.dtype {inputs[input_name][1]!r} is not "
                                                      "int32 or int64"))
    for input_name in ("q", "k_cache", "v_cache"):
        if inputs[input_name][1] not in FLOAT_DTYPES:
            raise DatasetError(_where(definition, f"inputs.{input_name}.dtype {inputs[input_name][1]!r}: kvdbg "
                                                  f"imports {', '.join(FLOAT_DTYPES)} (a gqa_paged definition names "
                                                  "no FP8 scales)"))
    scale_shape, scale_dtype = inputs["sm_scale"]
    if scale_shape not in (None, []) or scale_dtype not in FLOAT_DTYPES:
        raise DatasetError(_where(definition, f"inputs.sm_scale must be a float scalar (shape null or []), got shape "
                                              f"{scale_shape} dtype {scale_dtype!r}"))

    reference = data.get("reference")
    tags = data.get("tags") if isinstance(data.get("tags"), list) else []
    provenance = {
        "definition": name, "op_type": _op_type(data), "stage": stage, "definition_file": definition.where,
        "description": str(data.get("description") or "")[:300], "tags": [str(t)[:80] for t in tags[:20]],
        "reference_sha256": hashlib.sha256(reference.encode("utf-8", "replace")).hexdigest()
        if isinstance(reference, str) else None,
    }
    return PagedDefinition(name=name, where=definition.where, stage=stage, kv_layout=kv_layout,
                           num_qo_heads=axes["num_qo_heads"], num_kv_heads=axes["num_kv_heads"],
                           head_dim=axes["head_dim"], page_size=axes["page_size"],
                           last_page_input=last[0] if last else None, axes=axes, inputs=inputs, provenance=provenance)


# ----------------------------------------------------------------------------- a workload


def _axis_values(pdef: PagedDefinition, line: WorkloadLine, where: str, stored: list[str]) -> dict[str, int]:
    """Every axis's value: the definition's consts and the workload's vars, each checked; every axis of a
    ``stored`` input's shape must have one."""
    values: dict[str, int] = {}
    for axis, value in line.axes.items():
        if axis not in pdef.axes:
            raise DatasetError(f"{where}: axes.{axis} is not an axis of {pdef.name}")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_AXIS:
            raise DatasetError(f"{where}: axes.{axis} = {repr(value)[:40]} must be an integer in [0, {MAX_AXIS}]")
        if pdef.axes[axis] is not None and value != pdef.axes[axis]:
            raise DatasetError(f"{where}: axes.{axis} = {value}, but {pdef.name} fixes it at {pdef.axes[axis]}")
        values[axis] = value
    for axis, const in pdef.axes.items():
        if const is not None:
            values[axis] = const
    missing = sorted({a for name in stored for a in pdef.inputs[name][0] or ()} - set(values))
    if missing:
        raise DatasetError(f"{where}: axes.{missing[0]} is not given (a var axis of {pdef.name})")
    return values


def _scale(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise DatasetError(f"{where} must be a finite number > 0, got {repr(value)[:40]}")
    return float(value)


@dataclass
class InputPlan:
    """What a workload's inputs are, checked without reading a tensor: each stored input's file (inside the
    root), tensor key and expected shape, the scalar scale, and the location for messages."""

    where: str
    stored: dict[str, tuple[Any, Any, list[int], str]]  # name -> (path, tensor_key, shape, dtype)
    scale: float | None  # sm_scale given as a scalar
    scale_from: str


def plan_inputs(dataset: Dataset, pdef: PagedDefinition, line: WorkloadLine) -> InputPlan:
    """Check ``line`` against ``pdef`` (axes, input kinds, blob paths) before any tensor is read: a random input,
    a path leading out of the dataset or a blob that is not a regular file is refused here."""
    where = f"{line.where} ({line.uuid})"
    for name in line.inputs:
        if name not in pdef.inputs:
            raise DatasetError(f"{where}: inputs.{name} is not an input of {pdef.name}")
    random, given = [], {}
    for name in pdef.inputs:
        spec = line.inputs.get(name)
        kind = spec.get("type") if isinstance(spec, dict) else ("random" if spec is None else None)
        if kind == "random":
            random.append(name)
        elif kind in ("scalar", "safetensors"):
            given[name] = (kind, spec)
        else:
            raise DatasetError(f"{where}: inputs.{name} must be an object of type random, scalar or safetensors, "
                               f"got {repr(spec)[:60]}")
    if random:
        raise DatasetError(f"{where}: input(s) {', '.join(random)} are random: flashinfer-bench draws them when it "
                           "runs the workload, so they were never recorded"
                           + (f" (stored: {', '.join(given)})" if given else "")
                           + "; record them with the tracing input_dump_policy dump_all, or make a synthetic "
                             "snapshot with kvdbg synth")
    values = _axis_values(pdef, line, where, [n for n, (kind, _) in given.items() if kind == "safetensors"])
    stored, scale = {}, None
    for name, (kind, spec) in given.items():
        if kind == "scalar":
            if name != "sm_scale":
                raise DatasetError(f"{where}: inputs.{name} is a scalar, but the definition declares a tensor")
            scale = _scale(spec.get("value"), f"{where}: inputs.{name}.value")
            continue
        shape_names, dtype = pdef.inputs[name]
        stored[name] = (dataset.blob_path(spec.get("path"), f"{where}: inputs.{name}"), spec.get("tensor_key"),
                        [values[a] for a in shape_names or []], dtype)
    return InputPlan(where, stored, scale, f"{given['sm_scale'][0]} input")


def read_inputs(plan: InputPlan) -> dict[str, Any]:
    """The planned inputs by name (tensors, and sm_scale as a float); each tensor's header is checked before its
    data is read."""
    read: dict[str, Any] = {}
    handles: dict = {}
    for name, (path, key, shape, dtype) in plan.stored.items():
        tensor = read_tensor(path, key, shape, dtype, f"{plan.where}: inputs.{name}", handles)
        read[name] = _scale(float(tensor.reshape(-1)[0]), f"{plan.where}: inputs.sm_scale") if name == "sm_scale" \
            else tensor
    handles.clear()
    if plan.scale is not None:
        read["sm_scale"] = plan.scale
    return read


def _indptr(tensor, name: str, where: str) -> list[int]:
    values = [int(v) for v in tensor.tolist()]
    if len(values) < 2:
        raise DatasetError(f"{where}: {name} has {len(values)} entries; it needs one more than the requests (>= 1)")
    if values[0] < 0:
        raise DatasetError(f"{where}: {name}[0] = {values[0]} is negative")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise DatasetError(f"{where}: {name}[{i}] = {values[i]} < {name}[{i - 1}] = {values[i - 1]}: {name} "
                               "must never decrease")
    return values


def workload_call(dataset: Dataset, pdef: PagedDefinition, line: WorkloadLine, plan: InputPlan) -> PagedCall:
    """The paged call of one workload of ``pdef`` (``plan``: :func:`plan_inputs`): its tensors read and every
    index checked, naming the input."""
    import torch

    where = plan.where
    a = read_inputs(plan)
    q, k_cache, v_cache = a["q"], a["k_cache"], a["v_cache"]
    pages = k_cache.shape[0]
    kv_indptr = _indptr(a["kv_indptr"], "kv_indptr", where)
    batch = len(kv_indptr) - 1
    kv_indices = a["kv_indices"].to(torch.int64)
    if kv_indptr[-1] > kv_indices.numel():
        raise DatasetError(f"{where}: kv_indptr[-1] = {kv_indptr[-1]}, but kv_indices holds {kv_indices.numel()} "
                           "entries")
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= pages):
        bad = int(((kv_indices < 0) | (kv_indices >= pages)).nonzero()[0, 0])
        raise DatasetError(f"{where}: kv_indices[{bad}] = {int(kv_indices[bad])} is outside k_cache's {pages} pages")
    for r in range(batch):
        if kv_indptr[r + 1] == kv_indptr[r]:
            raise DatasetError(f"{where}: kv_indptr gives request {r} no page (kv_indptr[{r}] = kv_indptr[{r + 1}] "
                               f"= {kv_indptr[r]}): the reference writes zeros there, and a kvdbg snapshot holds "
                               "requests that have keys")

    if pdef.stage == PREFILL:
        qo_indptr = _indptr(a["qo_indptr"], "qo_indptr", where)
        if len(qo_indptr) != len(kv_indptr):
            raise DatasetError(f"{where}: qo_indptr has {len(qo_indptr)} entries, kv_indptr {len(kv_indptr)}: one "
                               "each per request, plus one")
        if qo_indptr[0] != 0 or qo_indptr[-1] != q.shape[0]:
            raise DatasetError(f"{where}: qo_indptr must run from 0 to q's {q.shape[0]} rows, got {qo_indptr[0]} .. "
                               f"{qo_indptr[-1]}")
    else:
        if q.shape[0] != batch:
            raise DatasetError(f"{where}: q has {q.shape[0]} rows but kv_indptr describes {batch} requests (a decode "
                               "workload has one query per request)")
        qo_indptr = list(range(batch + 1))

    if pdef.last_page_input is not None:
        name = pdef.last_page_input
        last = a[name].to(torch.int64).tolist()
        padded = pdef.inputs[name][0] == pdef.inputs["kv_indptr"][0]  # declared over kv_indptr's axis: B + 1
        if len(last) != batch and not (padded and len(last) == batch + 1):
            raise DatasetError(f"{where}: {name} has {len(last)} entries for {batch} requests")
        last = last[:batch]
        for r, value in enumerate(last):
            if not 0 <= value <= pdef.page_size:
                raise DatasetError(f"{where}: {name}[{r}] = {value} is outside [0, page_size {pdef.page_size}]")
        last_from = f"the {name} input"
    else:
        last = [pdef.page_size] * batch
        last_from = "none given: every page is full, as the definition has no last-page input"
    for r in range(batch):
        keys = (kv_indptr[r + 1] - kv_indptr[r] - 1) * pdef.page_size + last[r]
        queries = qo_indptr[r + 1] - qo_indptr[r]
        if queries > keys:
            raise DatasetError(f"{where}: request {r} has {queries} queries (qo_indptr) but {keys} keys: the reference "
                               "leaves the first rows unattended, which a kvdbg snapshot does not hold")

    provenance = {
        "engine": "flashinfer-bench dataset", "source": "flashinfer-bench", **pdef.provenance,
        "workload": line.uuid, "workload_file": line.where, "dataset": str(dataset.root),
        "blobs": sorted({dataset.relative(path) for path, *_ in plan.stored.values()}), "kv_layout": pdef.kv_layout,
        "kv_layout_from": "the definition's k_cache shape (axis names)", "last_page_len_from": last_from,
        "mask": "causal, bottom-right aligned (gqa_paged prefill)" if pdef.stage == PREFILL
        else "one query per request, every key (gqa_paged decode)",
        "sm_scale_from": plan.scale_from,
        "output_recorded": False,
    }
    return PagedCall(
        function=f"{pdef.name} workload {line.uuid}", kv_layout=pdef.kv_layout, q=q, k_cache=k_cache,
        v_cache=v_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last,
        num_qo_heads=pdef.num_qo_heads, num_kv_heads=pdef.num_kv_heads, head_dim=pdef.head_dim,
        page_size=pdef.page_size, causal=True, sm_scale=a["sm_scale"], output=None, provenance=provenance)
