"""Placement: Megatron shards -> canonical (Hugging Face) coordinates through fixed maps."""

from nemo_dcr_callback.placement.export import dense_export
from nemo_dcr_callback.placement.families import FAMILIES, LLAMA, MISTRAL, QWEN2, QWEN3, Family, MapKind, Rule
from nemo_dcr_callback.placement.maps import ParamMap, Placement, build_placement

__all__ = ["FAMILIES", "LLAMA", "MISTRAL", "QWEN2", "QWEN3", "Family", "MapKind", "ParamMap", "Placement",
           "Rule", "build_placement", "dense_export"]
