"""The version-1 shard contract shared by `extract` (writer) and `calibrate` (reader). See `schemas.shard`."""

from schemas.shard import (
    COMPLETE_MARKER,
    META_KEYS,
    OPTIONAL_META_KEYS,
    OPTIONAL_COLUMNS,
    OUTPUT_KINDS,
    PART_TEMPLATE,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    Completeness,
    PartialRunError,
    RunKey,
    Shard,
    ShardError,
    ShardMeta,
    build_table,
    error_line,
    find_shards,
    group_shards,
    iter_run,
    read_meta,
    read_shard,
    run_completeness,
    shard_dir,
    shard_path,
    validate_shard,
    write_atomic_table,
    write_shard,
)

__all__ = [
    "COMPLETE_MARKER", "Completeness", "META_KEYS", "OPTIONAL_COLUMNS", "OPTIONAL_META_KEYS", "OUTPUT_KINDS", "PART_TEMPLATE",
    "PartialRunError", "REQUIRED_COLUMNS", "SCHEMA_VERSION", "RunKey", "Shard", "ShardError", "ShardMeta",
    "build_table", "error_line", "find_shards", "group_shards", "iter_run", "read_meta", "read_shard",
    "run_completeness", "shard_dir", "shard_path", "validate_shard", "write_atomic_table", "write_shard",
]
