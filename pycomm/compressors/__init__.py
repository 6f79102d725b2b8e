"""Compressor families, each a module registered by name."""

from .base import Compressor, compressor_class, compressor_names, register, register_compressor
from .onebit import OneBitCompressor, OneBitPayload
from . import plugin  # noqa: F401 - registers the ops the engine calls registered compressors through
from .quant import Int4Compressor, Int8Compressor, QuantCompressor, QuantPayload, quant_class
from .topk import TopKCompressor, TopKPayload

__all__ = [
    "Compressor",
    "Int4Compressor",
    "Int8Compressor",
    "OneBitCompressor",
    "OneBitPayload",
    "QuantCompressor",
    "QuantPayload",
    "TopKCompressor",
    "TopKPayload",
    "compressor_class",
    "compressor_names",
    "quant_class",
    "register",
    "register_compressor",
]
