"""bench/graph_cost.py (run on a GPU by the lead) against vLLM 0.33's own classes: its engine arguments make the
engine configuration it means, and what it wraps to time is where vLLM 0.33 calls it.

The engine itself needs a GPU: the configuration is made here with vLLM's CUDA platform stood in for (compute
capability 9.0, an H200's memory), in a process of its own, with the compiled modules stubbed as on the GPU
machine (tests/gpu/stub_site).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys

from tests.helpers import ROOT

CONFIG_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.environ["ROOT"])
import importlib.util
spec = importlib.util.spec_from_file_location("graph_cost", os.path.join(os.environ["ROOT"], "bench", "graph_cost.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
os.environ.update(bench.kind_environment("capture", os.environ["SCRATCH"]))
import vllm.platforms as platforms
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import DeviceCapability
CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
CudaPlatform.get_device_name = classmethod(lambda cls, device_id=0: "NVIDIA H200")
CudaPlatform.get_device_total_memory = classmethod(lambda cls, device_id=0: 140 * 2**30)
platforms._current_platform = CudaPlatform()
from vllm.engine.arg_utils import EngineArgs
model = bench.write_model(os.environ["SCRATCH"] + "/model", 8)
config = EngineArgs(**bench.engine_arguments(model, 64, 128, 128)).create_engine_config()
c = config.compilation_config
print("CONFIG " + json.dumps({
    "mode": str(c.cudagraph_mode), "sizes": list(c.cudagraph_capture_sizes),
    "async": config.scheduler_config.async_scheduling,
    "max_model_len": config.model_config.max_model_len, "batched": config.scheduler_config.max_num_batched_tokens,
    "seqs": config.scheduler_config.max_num_seqs, "blocks": config.cache_config.num_gpu_blocks_override,
    "load": str(config.load_config.load_format), "layers": config.model_config.hf_config.num_hidden_layers,
    "heads": [config.model_config.get_num_attention_heads(config.parallel_config),
              config.model_config.get_num_kv_heads(config.parallel_config), config.model_config.get_head_size()],
    "prefix_caching": config.cache_config.enable_prefix_caching, "dtype": str(config.model_config.dtype)}))
"""


def test_the_benchs_engine_arguments_make_the_engine_it_means(tmp_path):
    dist = importlib.metadata.distribution("vllm")
    compiled = sorted({str(f).split(".", 1)[0].replace("/", ".") for f in dist.files or [] if str(f).endswith(".so")})
    so_list = tmp_path / "so-modules.txt"
    so_list.write_text("".join(f"{name}\n" for name in compiled))
    env = dict(os.environ, ROOT=ROOT, SCRATCH=str(tmp_path), KVDBG_GPU_VLLM_SO_MODULES=str(so_list),
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "gpu", "stub_site"), ROOT]))
    done = subprocess.run([sys.executable, "-c", CONFIG_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("CONFIG ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    config = json.loads(lines[-1][len("CONFIG "):])
    assert config["mode"].endswith("FULL_DECODE_ONLY") and config["sizes"] == [64]
    assert config["async"] is True  # vLLM's default here: the bench reports it with its figures
    assert config["layers"] == 8 and config["heads"] == [32, 8, 128] and config["dtype"] == "torch.bfloat16"
    assert config["load"] == "dummy" and config["prefix_caching"] is False
    # One round (64 requests of 128 + 128 tokens) prefills in one step and fits the cache.
    assert config["batched"] >= 64 * 128 and config["seqs"] == 64 and config["max_model_len"] >= 256
    assert config["blocks"] >= 64 * config["max_model_len"] // 16


def test_what_the_bench_wraps_is_where_vllm_033_calls_it():
    import torch
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.entrypoints.common import offline
    from vllm.plugins import load_plugins_by_group
    from vllm.v1.engine.llm_engine import LLMEngine

    # Each engine step: LLM.generate steps the engine through the LLMEngine instance's attribute.
    assert callable(LLMEngine.step) and "self.llm_engine.step()" in inspect.getsource(offline)
    # Each replay: vLLM's graph wrapper replays torch's CUDAGraph, whose replay the bench times.
    assert "entry.cudagraph.replay()" in inspect.getsource(CUDAGraphWrapper.__call__)
    assert "cudagraph = torch.cuda.CUDAGraph()" in inspect.getsource(CUDAGraphWrapper.__call__)
    assert "replay" in torch.cuda.CUDAGraph.__dict__
    # kvdbg absent: VLLM_PLUGINS names every plugin but kvdbg's, and vLLM loads only the plugins named.
    assert "plugin.name in allowed_plugins" in inspect.getsource(load_plugins_by_group)
    spec = importlib.util.spec_from_file_location("graph_cost", os.path.join(ROOT, "bench", "graph_cost.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    named = bench.plugins_without_kvdbg().split(",")
    assert "kvdbg" not in named and "lora_filesystem_resolver" in named  # vLLM's own general plugins stay
    from vllm import LLM, SamplingParams

    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert "use_tqdm" in inspect.signature(LLM.generate).parameters
