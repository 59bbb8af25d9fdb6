"""Data loading: grain pipeline from chat / plain-text JSONL and Parquet to packed int32 batches."""

from farskip_jax.data.pipeline import (
    ChatTemplate,
    DataConfig,
    DataCounters,
    DataPipeline,
    MalformedRecordError,
    RecordSource,
    Tokenize,
    build_pipeline,
    load_tokenizer,
)

__all__ = [
    "ChatTemplate",
    "DataConfig",
    "DataCounters",
    "DataPipeline",
    "MalformedRecordError",
    "RecordSource",
    "Tokenize",
    "build_pipeline",
    "load_tokenizer",
]
