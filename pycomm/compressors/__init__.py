"""Compressor families, each a module registered by name."""

from .base import Compressor, compressor_class, compressor_names, register, register_compressor
from .onebit import OneBitCompressor, OneBitPayload
from .plugin import is_plugin  # also registers the ops the engine calls plugins through
from .quant import Int4Compressor, Int8Compressor, QuantPayload
from .topk import TopKCompressor, TopKPayload

__all__ = [
    "Compressor",
    "Int4Compressor",
    "Int8Compressor",
    "OneBitCompressor",
    "OneBitPayload",
    "QuantPayload",
    "TopKCompressor",
    "TopKPayload",
    "compressor_class",
    "compressor_names",
    "is_plugin",
    "register",
    "register_compressor",
]
