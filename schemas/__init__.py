"""The version-1 shard contract shared by `extract` (writer) and `calibrate` (reader).

    shard.py   the format (columns, types, file metadata, version), its writer, reader and validation
    atomic.py  writing files atomically (temporary name, then rename) and checking output folders

Every name is imported from its module (`from schemas.shard import read_shard`); the package forwards nothing.
"""
