"""Stand-in for vllm.v1.attention.backends.registry: name -> backend class, with overrides.

Lists the members the 0.33 registry read for kvdbg has near the two backends
kvdbg cares about; FLASHINFER_TS is not among them there, so it is not here.
"""

from __future__ import annotations

from enum import Enum, EnumMeta

from vllm.utils.import_utils import resolve_obj_by_qualname


class _AttentionBackendEnumMeta(EnumMeta):
    def __getitem__(cls, name: str):
        try:
            return super().__getitem__(name)
        except KeyError:
            valid = ", ".join(cls.__members__)
            raise ValueError(f"Unknown attention backend: '{name}'. Valid options are: {valid}") from None


class AttentionBackendEnum(Enum, metaclass=_AttentionBackendEnumMeta):
    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    FLASHINFER = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    FLEX_ATTENTION = "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    CUSTOM = None

    def get_path(self, include_classname: bool = True) -> str:
        path = _ATTN_OVERRIDES.get(self, self.value)
        if not path:
            raise ValueError(f"Backend {self.name} must be registered before use.")
        return path if include_classname else path.rsplit(".", 1)[0]

    def get_class(self):
        return resolve_obj_by_qualname(self.get_path())


_ATTN_OVERRIDES: dict[AttentionBackendEnum, str] = {}


def register_backend(backend: AttentionBackendEnum, class_path: str | None = None):
    def decorator(cls: type) -> type:
        _ATTN_OVERRIDES[backend] = f"{cls.__module__}.{cls.__qualname__}"
        return cls

    if class_path is not None:
        _ATTN_OVERRIDES[backend] = class_path
        return lambda x: x
    return decorator
