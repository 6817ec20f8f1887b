"""kvdbg.capture.config: the KVDBG_CAPTURE_* variables, parsed once into a frozen configuration."""

from __future__ import annotations

import dataclasses

import pytest

from kvdbg import vllm_plugin
from kvdbg.capture.capturer import Capturer
from kvdbg.capture.config import ENV_DIR, CaptureConfig, LayerFilter, auto_queue_bytes, available_memory
from kvdbg.errors import OptionError
from tests.helpers import run_python


def test_from_env_reads_every_variable(tmp_path):
    config = CaptureConfig.from_env({
        "KVDBG_CAPTURE_DIR": f" {tmp_path} ", "KVDBG_CAPTURE_MAX": "5", "KVDBG_CAPTURE_MAX_BYTES": "512M",
        "KVDBG_CAPTURE_LAYERS": "*.layers.2.*", "KVDBG_CAPTURE_STEPS": "10 - 20", "KVDBG_CAPTURE_RANKS": "0,2",
        "KVDBG_CAPTURE_QUEUE_BYTES": "0", "KVDBG_CAPTURE_BACKENDS": "cpu_attn, FLEX_ATTENTION,cpu_attn",
    })
    assert config.directory == str(tmp_path)
    assert (config.max_snapshots, config.max_bytes, config.queue_bytes) == (5, 512 * 1024**2, 0)
    assert not config.background
    assert config.backends == ("CPU_ATTN", "FLEX_ATTENTION") and config.backends_given
    capturer = Capturer(config)
    assert capturer.wants("m.layers.2.attn", 15, rank=2)
    assert not capturer.wants("m.layers.2.attn", 21, rank=2)
    assert not capturer.wants("m.layers.3.attn", 15, rank=2)
    assert not capturer.wants("m.layers.2.attn", 15, rank=1)


def test_unset_variables_take_the_safe_defaults(tmp_path):
    config = CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_STEPS": "  "})
    assert (config.max_snapshots, config.max_bytes, config.queue_bytes) == (32, 4 * 1024**3, "auto")
    assert config.background
    assert config.steps is None and config.ranks is None and config.layers("any.layer")
    assert config.backends == () and not config.backends_given  # each attention layer's own backend
    assert CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_BACKENDS": " Auto "}) == config
    unlimited = CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_MAX": "unlimited",
                                        "KVDBG_CAPTURE_MAX_BYTES": "UNLIMITED"})
    assert unlimited.max_snapshots is None and unlimited.max_bytes is None
    # The Python API's own defaults: no caps, writes in the caller's thread.
    api = CaptureConfig(tmp_path)
    assert (api.max_snapshots, api.max_bytes, api.queue_bytes) == (None, None, 0)
    sized = CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_QUEUE_BYTES": "2G"})
    assert sized.queue_bytes == 2 * 1024**3


@pytest.mark.parametrize("variable, value, says", [
    ("KVDBG_CAPTURE_MAX", "0", "KVDBG_CAPTURE_MAX must be a positive integer or 'unlimited', got '0'"),
    ("KVDBG_CAPTURE_MAX", "٣", "KVDBG_CAPTURE_MAX must be a positive integer"),
    ("KVDBG_CAPTURE_MAX", "9" * 5000, "KVDBG_CAPTURE_MAX must be a positive integer"),
    ("KVDBG_CAPTURE_MAX_BYTES", "lots", "KVDBG_CAPTURE_MAX_BYTES must be bytes like 500000, 512M or 4GiB"),
    ("KVDBG_CAPTURE_MAX_BYTES", "9" * 5000 + "G", "KVDBG_CAPTURE_MAX_BYTES must be bytes like"),
    ("KVDBG_CAPTURE_QUEUE", "8", "KVDBG_CAPTURE_QUEUE (a count of snapshots) was replaced by "
                                 "KVDBG_CAPTURE_QUEUE_BYTES (a memory budget; default auto, 0 writes in the engine's "
                                 "thread): unset it"),
    ("KVDBG_CAPTURE_QUEUE_BYTES", "-1", "KVDBG_CAPTURE_QUEUE_BYTES must be bytes like 500000, 512M or 4GiB"),
    ("KVDBG_CAPTURE_QUEUE_BYTES", "unlimited", "KVDBG_CAPTURE_QUEUE_BYTES cannot be unlimited"),
    ("KVDBG_CAPTURE_STEPS", "ten-twenty", "KVDBG_CAPTURE_STEPS: 'ten-twenty' is not a number or a range"),
    ("KVDBG_CAPTURE_STEPS", "5-3", "KVDBG_CAPTURE_STEPS: range '5-3' ends before it starts"),
    ("KVDBG_CAPTURE_RANKS", "0,,1", "KVDBG_CAPTURE_RANKS: '0,,1' has an empty item between commas"),
    ("KVDBG_CAPTURE_LAYERS", "re:(", "KVDBG_CAPTURE_LAYERS 're:(' is not a valid regular expression"),
    ("KVDBG_CAPTURE_LAYERS", " , ", "KVDBG_CAPTURE_LAYERS is empty"),
    ("KVDBG_CAPTURE_BACKENDS", ",", "KVDBG_CAPTURE_BACKENDS names no backend"),
    ("KVDBG_CAPTURE_BACKENDS", "auto,FLASH_ATTN", "KVDBG_CAPTURE_BACKENDS: 'auto' stands alone"),
])
def test_a_bad_variable_is_one_line_naming_it(tmp_path, variable, value, says):
    with pytest.raises(OptionError) as info:
        CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), variable: value})
    message = str(info.value)
    assert says in message and "\n" not in message and len(message) < 200, message


def test_the_directory_is_required():
    with pytest.raises(OptionError, match="KVDBG_CAPTURE_DIR is not set"):
        CaptureConfig.from_env({})
    with pytest.raises(OptionError, match="KVDBG_CAPTURE_DIR is not set"):
        CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": "   "})


def test_the_configuration_is_frozen_and_replaced_whole(tmp_path):
    config = CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_STEPS": "3"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_snapshots = 1
    capturer = Capturer(config)
    assert capturer.wants("layer", 3) and not capturer.wants("layer", 4)
    capturer.reconfigure(steps="4-")
    assert not capturer.wants("layer", 3) and capturer.wants("layer", 10**12)
    assert config.steps is not None and 3 in config.steps  # the original is untouched
    with pytest.raises(OptionError, match="max_snapshots must be a positive integer"):
        capturer.reconfigure(max_snapshots=0)


def test_layer_filter_globs_and_regex():
    glob = LayerFilter("*.layers.1.*,model.layers.3.self_attn.attn")
    assert glob("model.layers.1.self_attn.attn") and glob("model.layers.3.self_attn.attn")
    assert not glob("model.layers.11.self_attn.attn") and not glob("model.layers.3.self_attn.attn.x")
    regex = LayerFilter(r"re:layers\.(2|5)\.")
    assert regex("model.layers.5.self_attn.attn") and not regex("model.layers.25.self_attn.attn")
    assert LayerFilter(None)("anything")
    with pytest.raises(OptionError):
        LayerFilter("re:(")


def test_describe_names_filters_and_budgets(tmp_path):
    config = CaptureConfig.from_env({"KVDBG_CAPTURE_DIR": str(tmp_path), "KVDBG_CAPTURE_STEPS": "2,0-1,9-",
                                     "KVDBG_CAPTURE_MAX": "unlimited"})
    assert config.describe() == (f"directory={tmp_path} layers=all layers steps=0-2,9- ranks=all max=unlimited "
                                 f"max_bytes={4 * 1024**3} bytes writer=background, queue up to 25% of the memory "
                                 "available when it starts")


def test_the_auto_queue_budget_is_a_quarter_of_available_memory_within_the_byte_budget():
    assert auto_queue_bytes(None, available=8 * 1024**3) == (2 * 1024**3, "25% of the 8192 MiB available")
    assert auto_queue_bytes(None, available=10 * 1024**2)[0] == 64 * 1024**2  # the floor
    assert auto_queue_bytes(512 * 1024**2, available=8 * 1024**3) == (
        512 * 1024**2, "KVDBG_CAPTURE_MAX_BYTES, below 25% of the 8192 MiB available")
    found = available_memory()
    assert found is None or found > 0


def test_reading_the_configuration_needs_no_torch():
    out = run_python("import sys, kvdbg.capture.config as c; "
                     "c.CaptureConfig.from_env({'KVDBG_CAPTURE_DIR': 'x', 'KVDBG_CAPTURE_STEPS': '1-'}); "
                     "print('torch' in sys.modules)")
    assert out.strip() == "False"


def test_the_plugin_reads_the_same_variable():
    assert vllm_plugin.ENV_DIR == ENV_DIR
