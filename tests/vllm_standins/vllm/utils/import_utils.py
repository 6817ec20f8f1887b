"""Stand-in for vllm.utils.import_utils: resolve a dotted ``module.Class`` path."""

import importlib


def resolve_obj_by_qualname(qualname: str):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)
