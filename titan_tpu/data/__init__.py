"""Data: document sources -> tokenizer -> packed, shuffled, dp-sharded batches with resumable state."""

from titan_tpu.data.documents import DocumentSource
from titan_tpu.data.loader import PackedDataset, build_dataloader, build_source
from titan_tpu.data.sources import EmbeddedSource
from titan_tpu.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DocumentSource",
    "EmbeddedSource",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "build_dataloader",
    "build_source",
    "build_tokenizer",
]
