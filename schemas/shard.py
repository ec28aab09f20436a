"""The shard contract, version 1: the only coupling between `extract/` and `calibrate/`.

A shard is a Parquet file holding one slice of one run (backbone, dataset, method, seed).

Required columns:
    sample_id   int64                        index in the dataset's canonical test order
    label       int32                        ground-truth class index in [0, K); -1 (`OOD_LABEL`, "no class") on
                                             the out-of-distribution rows of an OOD run (`zaec:ood_for`) only
    zs_logits   fixed_size_list<float32>[K]  paired zero-shot logits (logit scale included)
    tta_logits  fixed_size_list<float32>[K]  adapted logits of the same sample
Optional columns:
    stream_pos  int64                        position in the adaptation stream
    (more columns may be added; readers ignore what they do not know)

File key-value metadata (all values are strings): see `META_KEYS`.
Default layout under an output root:
    <root>/backbone=<b>/dataset=<d>/method=<m>/seed=<s>/part-<00000>.parquet
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.atomic import atomic_path

SCHEMA_VERSION = "1"
PREFIX = "zaec:"

#: metadata key -> meaning (all stored as strings)
META_KEYS: dict[str, str] = {
    "zaec:schema": 'contract version, "1"',
    "zaec:backbone": "model name as open_clip spells it (ViT-B-16, RN50, ...)",
    "zaec:pretrained": "pretrained tag, checkpoint path or local-dir:DIR",
    "zaec:dataset": "canonical dataset key (imagenet_a, dtd, ...)",
    "zaec:method": "TTA method key (zero-shot, tda, dpe, ...)",
    "zaec:seed": "seed of the stream permutation and the views (integer as a string)",
    "zaec:num_classes": "K (integer as a string)",
    "zaec:class_names": "JSON array of K class names",
    "zaec:method_config": "JSON object: the method's resolved configuration",
    "zaec:zs_prompts": "JSON: what produced the zero-shot logits (templates, views)",
}
#: optional metadata keys `zaec-extract` writes (other writers may omit them; readers cope without them)
OPTIONAL_META_KEYS: dict[str, str] = {
    "zaec:n_total": "number of samples in the dataset's test set (integer as a string)",
    "zaec:limit": 'the run\'s --limit (integer as a string) or "none": the run covers the first min(limit, '
                  "n_total) stream positions",
    "zaec:data_root": "the resolved (absolute) data root the images were read from",
    "zaec:data_fingerprint": '"<mode>:<hex>": fingerprint of the image files (stat: path, size, mtime; content: '
                             "sha256)",
    "zaec:output_kind": 'what the tta_logits rows are: "logits" (default when the key is absent) or "log_probs" '
                        "(finite natural-log probabilities; see docs/contract.md)",
    "zaec:adapt_batch": "samples per adapt call (integer as a string; absent: 64); for a method that adapts over "
                        "batches of test images (zaec:consumes = batch_pixels) its batch: stream positions "
                        "[k*B, (k+1)*B) are adapted together, the last batch of a run shorter",
    "zaec:consumes": 'what the method read besides the cached features, where it matters to the rows: "batch_pixels" '
                     "(the image encoder adapted over batches of the original views, so a row depends on its batch "
                     "and the batches before it)",
    "zaec:ood_for": "OOD runs only: the in-distribution dataset's key; the run's class names are that dataset's and "
                    "its out-of-distribution rows carry label -1 (docs/contract.md, \"Out-of-distribution runs\")",
    "zaec:ood_dataset": "OOD runs only: the out-of-distribution set's name; the run's dataset key is "
                        "`<ood_dataset>@<ood_for>` (`ood_run_dataset`)",
    "zaec:ood_n_id": "OOD runs, optional: in-distribution samples in the whole mixed stream (integer as a string)",
    "zaec:ood_n_ood": "OOD runs, optional: out-of-distribution samples in the whole mixed stream (integer as a "
                      "string); with zaec:ood_n_id it sums to zaec:n_total when that is present",
}
#: the label of an out-of-distribution row ("no class"), valid only in a shard whose metadata has `zaec:ood_for`
OOD_LABEL = -1
#: separates the OOD set's name from the in-distribution key in an OOD run's dataset key; never in a dataset name
OOD_SEPARATOR = "@"
#: values of `zaec:output_kind`; a shard without the key holds logits
OUTPUT_KINDS: tuple[str, ...] = ("logits", "log_probs")
#: the file a writer puts next to the parts of a finished run (JSON: n_samples, n_total, limit, parts, ...)
COMPLETE_MARKER = "_zaec_complete.json"
REQUIRED_COLUMNS = ("sample_id", "label", "zs_logits", "tta_logits")
OPTIONAL_COLUMNS = ("stream_pos",)
PART_TEMPLATE = "part-{:05d}.parquet"


class ShardError(ValueError):
    """A shard violates the contract. The message names the file and, where relevant, the column."""


def ood_run_dataset(ood_dataset: str, ood_for: str) -> str:
    """The dataset key of an OOD run: `<ood_dataset>@<ood_for>`, apart from every plain run's key.

    Example:
        >>> ood_run_dataset("inaturalist", "imagenet")
        'inaturalist@imagenet'
    """
    return f"{ood_dataset}{OOD_SEPARATOR}{ood_for}"


class PartialRunError(ShardError):
    """The shards of a run hold fewer samples than its writer announced (an interrupted or still running run)."""


@dataclass(frozen=True)
class RunKey:
    """The identity of one run: every shard of a run shares it."""

    backbone: str
    dataset: str
    method: str
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return {"backbone": self.backbone, "dataset": self.dataset, "method": self.method, "seed": self.seed}

    def __str__(self) -> str:  # used in messages and progress bars
        return f"{self.backbone}/{self.dataset}/{self.method}/seed={self.seed}"


@dataclass(frozen=True)
class ShardMeta:
    """File-level metadata of a shard (identical for every shard of a run, except the extractor's per-part
    `zaec:method_summary` / `zaec:method_state` notes in `extra`)."""

    backbone: str
    pretrained: str
    dataset: str
    method: str
    seed: int
    class_names: tuple[str, ...]
    method_config: Mapping[str, Any] = field(default_factory=dict)
    zs_prompts: Any = field(default_factory=dict)
    #: further `zaec:*` keys (strings), e.g. warnings recorded by the extractor
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def key(self) -> RunKey:
        return RunKey(self.backbone, self.dataset, self.method, int(self.seed))

    @property
    def ood_for(self) -> str | None:
        """The in-distribution dataset of an OOD run (`zaec:ood_for`); None for a plain run."""
        return self.extra.get("zaec:ood_for")

    @property
    def ood_dataset(self) -> str | None:
        """The out-of-distribution set of an OOD run (`zaec:ood_dataset`); None for a plain run."""
        return self.extra.get("zaec:ood_dataset")

    @property
    def min_label(self) -> int:
        """The smallest valid label: `OOD_LABEL` in an OOD run, else 0."""
        return OOD_LABEL if self.ood_for is not None else 0

    @property
    def output_kind(self) -> str:
        """What `tta_logits` holds: "logits" (also when `zaec:output_kind` is absent) or "log_probs"."""
        return self.extra.get("zaec:output_kind", "logits")

    def to_kv(self) -> dict[bytes, bytes]:
        kv = {
            "zaec:schema": SCHEMA_VERSION,
            "zaec:backbone": self.backbone,
            "zaec:pretrained": self.pretrained,
            "zaec:dataset": self.dataset,
            "zaec:method": self.method,
            "zaec:seed": str(int(self.seed)),
            "zaec:num_classes": str(self.num_classes),
            "zaec:class_names": json.dumps(list(self.class_names)),
            "zaec:method_config": json.dumps(dict(self.method_config), sort_keys=True, default=str),
            "zaec:zs_prompts": json.dumps(self.zs_prompts, sort_keys=True, default=str),
        }
        for k, v in self.extra.items():
            name = k if k.startswith(PREFIX) else PREFIX + k
            if name in kv:
                raise ValueError(f"extra metadata key {name!r} collides with a contract key")
            kv[name] = str(v)
        return {k.encode(): v.encode() for k, v in kv.items()}

    @classmethod
    def from_kv(cls, kv: Mapping[bytes, bytes] | None, path: str | os.PathLike = "<shard>") -> "ShardMeta":
        """Parse and validate file metadata; raises ShardError naming the file and the key."""
        meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (kv or {}).items()}
        if "zaec:schema" not in meta:
            raise ShardError(f"{path}: not a zaec shard (file metadata has no 'zaec:schema' key)")
        if meta["zaec:schema"] != SCHEMA_VERSION:
            raise ShardError(
                f"{path}: shard schema version {meta['zaec:schema']!r} is not supported; expected {SCHEMA_VERSION!r}"
            )
        missing = [k for k in META_KEYS if k not in meta]
        if missing:
            raise ShardError(f"{path}: file metadata is missing key(s) {', '.join(missing)}")

        def _json(key: str, kind: type | None = None) -> Any:
            try:
                value = json.loads(meta[key])
            except json.JSONDecodeError as e:
                raise ShardError(f"{path}: metadata {key!r} is not valid JSON ({e.msg})") from None
            if kind is not None and not isinstance(value, kind):
                raise ShardError(f"{path}: metadata {key!r} must be a JSON {kind.__name__}, got {type(value).__name__}")
            return value

        def _int(key: str) -> int:
            try:
                return int(meta[key])
            except ValueError:
                raise ShardError(f"{path}: metadata {key!r} must be an integer, got {meta[key]!r}") from None

        names = _json("zaec:class_names", list)
        k = _int("zaec:num_classes")
        if len(names) != k:
            raise ShardError(
                f"{path}: metadata 'zaec:class_names' has {len(names)} names but 'zaec:num_classes' is {k}"
            )
        extra = {key: v for key, v in meta.items() if key.startswith(PREFIX) and key not in META_KEYS}
        kind = extra.get("zaec:output_kind", "logits")
        if kind not in OUTPUT_KINDS:
            raise ShardError(f"{path}: metadata 'zaec:output_kind' must be one of {', '.join(OUTPUT_KINDS)}, "
                             f"got {kind!r}")
        _check_ood_meta(meta, path)
        return cls(
            backbone=meta["zaec:backbone"],
            pretrained=meta["zaec:pretrained"],
            dataset=meta["zaec:dataset"],
            method=meta["zaec:method"],
            seed=_int("zaec:seed"),
            class_names=tuple(str(n) for n in names),
            method_config=_json("zaec:method_config", dict),
            zs_prompts=_json("zaec:zs_prompts"),
            extra=extra,
        )


def _check_ood_meta(meta: Mapping[str, str], path: str | os.PathLike) -> None:
    """The OOD keys of one shard's metadata: both or neither of zaec:ood_for / zaec:ood_dataset, the dataset key
    `<ood_dataset>@<ood_for>`, counts that are non-negative integers summing to zaec:n_total."""
    ood_for, ood_ds = meta.get("zaec:ood_for"), meta.get("zaec:ood_dataset")
    counts = [k for k in ("zaec:ood_n_id", "zaec:ood_n_ood") if k in meta]
    if ood_for is None and ood_ds is None:
        if counts:
            raise ShardError(f"{path}: metadata {counts[0]!r} is set but 'zaec:ood_for' is not (OOD runs only)")
        return
    if not ood_for or not ood_ds:
        have, lack = ("zaec:ood_for", "zaec:ood_dataset") if ood_for else ("zaec:ood_dataset", "zaec:ood_for")
        raise ShardError(f"{path}: metadata {have!r} needs a non-empty {lack!r} (an OOD run names both sets)")
    if OOD_SEPARATOR in ood_for or OOD_SEPARATOR in ood_ds or ood_for == ood_ds:
        raise ShardError(f"{path}: metadata 'zaec:ood_for' ({ood_for!r}) and 'zaec:ood_dataset' ({ood_ds!r}) must "
                         f"be two different dataset names without {OOD_SEPARATOR!r}")
    want = ood_run_dataset(ood_ds, ood_for)
    if meta["zaec:dataset"] != want:
        raise ShardError(f"{path}: metadata 'zaec:dataset' of an OOD run must be {want!r} "
                         f"('<zaec:ood_dataset>@<zaec:ood_for>'), got {meta['zaec:dataset']!r}")
    values = []
    for key in counts:
        try:
            values.append(int(meta[key]))
        except ValueError:
            values.append(-1)
        if values[-1] < 0:
            raise ShardError(f"{path}: metadata {key!r} must be a non-negative integer, got {meta[key]!r}")
    total = meta.get("zaec:n_total")
    if len(values) == 2 and total is not None and total.lstrip("-").isdigit() and sum(values) != int(total):
        raise ShardError(f"{path}: metadata 'zaec:ood_n_id' + 'zaec:ood_n_ood' = {sum(values)} but "
                         f"'zaec:n_total' is {total}")


def check_labels(path: str | os.PathLike, meta: "ShardMeta", label: np.ndarray, sample_id: np.ndarray) -> None:
    """Labels of one shard against its metadata: [0, K) in a plain run; [0, K) or `OOD_LABEL` in an OOD run; with
    `zaec:ood_n_id` / `zaec:ood_n_ood`, in-distribution rows have sample_id in [0, n_id) and OOD rows in
    [n_id, n_id + n_ood) (docs/contract.md, "Out-of-distribution runs").

    Raises:
        ShardError: one line naming the file and the column.
    """
    k = meta.num_classes
    if not len(label):
        return
    is_ood, outside = label == OOD_LABEL, (label < 0) | (label >= k)
    if (outside & ~is_ood).any():
        bad = int((outside & ~(is_ood & (meta.ood_for is not None))).sum())
        allowed = f"[0, {k})" + (f" or {OOD_LABEL}" if meta.ood_for is not None else "")
        raise ShardError(f"{path}: column 'label' has {bad} value(s) outside {allowed}")
    if is_ood.any() and meta.ood_for is None:
        raise ShardError(f"{path}: column 'label' has {int(is_ood.sum())} value(s) of {OOD_LABEL} (out-of-"
                         "distribution, \"no class\") but the file metadata has no 'zaec:ood_for' naming the "
                         "in-distribution dataset (docs/contract.md, \"Out-of-distribution runs\")")
    if "zaec:ood_n_id" in meta.extra and "zaec:ood_n_ood" in meta.extra:
        n_id, n_ood = int(meta.extra["zaec:ood_n_id"]), int(meta.extra["zaec:ood_n_ood"])
        off = int((~is_ood & ((sample_id < 0) | (sample_id >= n_id))).sum()
                  + (is_ood & ((sample_id < n_id) | (sample_id >= n_id + n_ood))).sum())
        if off:
            raise ShardError(f"{path}: column 'sample_id' has {off} value(s) outside their kind's range "
                             f"(in-distribution: [0, {n_id}), out-of-distribution: [{n_id}, {n_id + n_ood}))")


@dataclass
class Shard:
    """One shard in memory: metadata plus numpy columns.

    Attributes:
        sample_id: (N,) int64
        label: (N,) int32
        zs_logits: (N, K) float32
        tta_logits: (N, K) float32
        stream_pos: (N,) int64 or None
        extra_columns: further columns as numpy arrays (read only when asked for)
    """

    path: Path
    meta: ShardMeta
    sample_id: np.ndarray
    label: np.ndarray
    zs_logits: np.ndarray
    tta_logits: np.ndarray
    stream_pos: np.ndarray | None = None
    extra_columns: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.sample_id.shape[0])

    def nonfinite_rows(self) -> np.ndarray:
        """(N,) bool: rows where either logit vector holds NaN or inf."""
        return ~(np.isfinite(self.zs_logits).all(axis=1) & np.isfinite(self.tta_logits).all(axis=1))

    def select(self, rows: np.ndarray) -> "Shard":
        """A new Shard with only `rows` (bool mask or indices)."""
        return Shard(
            self.path,
            self.meta,
            self.sample_id[rows],
            self.label[rows],
            self.zs_logits[rows],
            self.tta_logits[rows],
            None if self.stream_pos is None else self.stream_pos[rows],
            {k: v[rows] for k, v in self.extra_columns.items()},
        )


def shard_dir(root: str | os.PathLike, key: RunKey) -> Path:
    """`<root>/backbone=<b>/dataset=<d>/method=<m>/seed=<s>` for a run."""
    return (
        Path(root)
        / f"backbone={key.backbone}"
        / f"dataset={key.dataset}"
        / f"method={key.method}"
        / f"seed={key.seed}"
    )


def shard_path(root: str | os.PathLike, key: RunKey, part: int) -> Path:
    """Default path of part `part` of a run under `root`."""
    return shard_dir(root, key) / PART_TEMPLATE.format(part)


def _logits_array(x: np.ndarray, name: str) -> pa.FixedSizeListArray:
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (N, K), got {x.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), type=pa.float32()), x.shape[1])


def build_table(
    meta: ShardMeta,
    sample_id: Sequence[int] | np.ndarray,
    label: Sequence[int] | np.ndarray,
    zs_logits: np.ndarray,
    tta_logits: np.ndarray,
    stream_pos: Sequence[int] | np.ndarray | None = None,
    extra_columns: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Arrow table of one shard with the contract's types and metadata (validated)."""
    sample_id = np.asarray(sample_id, dtype=np.int64)
    label = np.asarray(label, dtype=np.int32)
    n, k = sample_id.shape[0], meta.num_classes
    for name, arr in (("zs_logits", zs_logits), ("tta_logits", tta_logits)):
        shape = np.shape(arr)
        if len(shape) != 2 or shape[0] != n or shape[1] != k:
            raise ValueError(f"{name} must have shape ({n}, {k}) to match sample_id and class_names; got {shape}")
    if label.shape != (n,):
        raise ValueError(f"label must have shape ({n},), got {label.shape}")
    if n and meta.ood_for is None and (label.min() < 0 or label.max() >= k) and not (label == OOD_LABEL).any():
        raise ValueError(f"label values must lie in [0, {k}); got range [{label.min()}, {label.max()}]")
    try:
        check_labels("<new shard>", meta, label, sample_id)
    except ShardError as e:
        raise ValueError(str(e)) from None
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array(sample_id, type=pa.int64()),
        "label": pa.array(label, type=pa.int32()),
        "zs_logits": _logits_array(zs_logits, "zs_logits"),
        "tta_logits": _logits_array(tta_logits, "tta_logits"),
    }
    if stream_pos is not None:
        sp = np.asarray(stream_pos, dtype=np.int64)
        if sp.shape != (n,):
            raise ValueError(f"stream_pos must have shape ({n},), got {sp.shape}")
        cols["stream_pos"] = pa.array(sp, type=pa.int64())
    for name, values in (extra_columns or {}).items():
        if name in cols:
            raise ValueError(f"extra column {name!r} collides with a contract column")
        cols[name] = pa.array(values)
    table = pa.table(cols)
    return table.replace_schema_metadata(meta.to_kv())


def write_atomic_table(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write a Parquet table to `path` atomically (temporary name in the same folder, fsync, rename)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def write_shard(
    path: str | os.PathLike,
    meta: ShardMeta,
    sample_id: Sequence[int] | np.ndarray,
    label: Sequence[int] | np.ndarray,
    zs_logits: np.ndarray,
    tta_logits: np.ndarray,
    stream_pos: Sequence[int] | np.ndarray | None = None,
    extra_columns: Mapping[str, Any] | None = None,
) -> Path:
    """Write one shard atomically (temporary name, then rename). Returns the final path.

    Example:
        >>> meta = ShardMeta("RN50", "openai", "dtd", "tda", 1, ("a", "b"))
        >>> write_shard(shard_path("out", meta.key, 0), meta, [0], [1], [[1.0, 2.0]], [[0.5, 3.0]])  # doctest: +SKIP
    """
    table = build_table(meta, sample_id, label, zs_logits, tta_logits, stream_pos, extra_columns)
    return write_atomic_table(table, path)


def _fixed_list_to_numpy(col: pa.ChunkedArray | pa.Array, k: int) -> np.ndarray:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = arr.flatten() if len(arr) else pa.array([], type=pa.float32())
    out = flat.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return out.reshape(len(arr), k)


def read_meta(path: str | os.PathLike) -> ShardMeta:
    """Read and validate only the file metadata of a shard (cheap: the footer)."""
    path = Path(path)
    try:
        footer = pq.ParquetFile(path).metadata
    except FileNotFoundError:
        raise ShardError(f"{path}: no such file") from None
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: not a readable Parquet file ({error_line(e)})") from None
    try:
        schema_kv = footer.schema.to_arrow_schema().metadata
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise ShardError(f"{path}: its Arrow schema cannot be read ({error_line(e)})") from None
    return ShardMeta.from_kv(merged_metadata(footer.metadata, schema_kv, path), path)


def merged_metadata(file_kv: Mapping[bytes, bytes] | None, schema_kv: Mapping[bytes, bytes] | None,
                    path: str | os.PathLike = "<shard>") -> dict[bytes, bytes]:
    """The `zaec:` keys wherever a writer put them: the Parquet file's key-value metadata or the Arrow schema's.

    pyarrow writes a table's schema metadata into both places; polars' `write_parquet(..., metadata=...)` writes
    only the file's key-value metadata (docs/contract.md names that place). A key present in both must agree.

    Raises:
        ShardError: a key whose two values differ, naming the file and the key.
    """
    out = {k: v for k, v in (file_kv or {}).items() if k != b"ARROW:schema"}
    for key, value in (schema_kv or {}).items():
        if key in out and out[key] != value:
            raise ShardError(f"{path}: metadata {key.decode(errors='replace')!r} differs between the Parquet "
                             "key-value metadata and the Arrow schema")
        out[key] = value
    return out


def error_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when empty): one line for a user-facing error."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _logits_type_fix(col: str, k: int) -> str:
    """How to write a logits column as the contract's fixed-size list from polars or pyarrow: a variable-length list
    (polars' `List(Float64)`, pyarrow's `list<double>`) is refused because the row width K is not in the type."""
    return (f"write it as a fixed-size list of K = {k}: polars `pl.col({col!r}).cast(pl.Array(pl.Float32, {k}))`, "
            f"pyarrow `pa.FixedSizeListArray.from_arrays(values, {k})` (type `pa.list_(pa.float32(), {k})`)")


def _check_schema(path: Path, schema: pa.Schema, k: int) -> None:
    names = set(schema.names)
    for col in REQUIRED_COLUMNS:
        if col not in names:
            raise ShardError(f"{path}: missing required column {col!r} (required: {', '.join(REQUIRED_COLUMNS)})")
    expect_int = {"sample_id": pa.int64(), "label": pa.int32(), "stream_pos": pa.int64()}
    for col, typ in expect_int.items():
        if col in names and not pa.types.is_integer(schema.field(col).type):
            raise ShardError(f"{path}: column {col!r} must be {typ}, got {schema.field(col).type}")
    for col in ("zs_logits", "tta_logits"):
        typ = schema.field(col).type
        if not pa.types.is_fixed_size_list(typ) or not pa.types.is_floating(typ.value_type):
            raise ShardError(f"{path}: column {col!r} must be fixed_size_list<float32>[{k}], got {typ}; "
                             + _logits_type_fix(col, k))
        if typ.list_size != k:
            raise ShardError(
                f"{path}: column {col!r} has {typ.list_size} logits per row but 'zaec:num_classes' is {k}"
            )


def read_shard(path: str | os.PathLike, *, columns: Iterable[str] = ()) -> Shard:
    """Read and validate one shard.

    Validation: metadata (version, keys, K), column presence and types, both logit widths equal K,
    labels in [0, K) (or -1 in an OOD run: `check_labels`), sample_id unique within the shard. Non-finite logits
    are NOT rejected here (callers decide: see `Shard.nonfinite_rows`).

    Args:
        path: the Parquet file.
        columns: extra (non-contract) columns to load into `Shard.extra_columns`.

    Raises:
        ShardError: one message naming the file and the column.
    """
    path = Path(path)
    meta = read_meta(path)
    k = meta.num_classes
    try:
        pf = pq.ParquetFile(path)
        _check_schema(path, pf.schema_arrow, k)
        want = list(REQUIRED_COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in pf.schema_arrow.names]
        want += [c for c in columns if c not in want]
        table = pf.read(columns=want)
    except ShardError:
        raise
    except KeyError as e:
        raise ShardError(f"{path}: requested column {e} is not in the shard") from None
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: Parquet data cannot be read ({error_line(e)})") from None
    for col in REQUIRED_COLUMNS:
        if table.column(col).null_count:
            raise ShardError(f"{path}: column {col!r} has {table.column(col).null_count} null value(s)")
    sample_id = table.column("sample_id").to_numpy().astype(np.int64, copy=False)
    label = table.column("label").to_numpy().astype(np.int64, copy=False)
    check_labels(path, meta, label, sample_id)
    if len(np.unique(sample_id)) != len(sample_id):
        dup = len(sample_id) - len(np.unique(sample_id))
        raise ShardError(f"{path}: column 'sample_id' has {dup} duplicate value(s) within the shard")
    stream_pos = None
    if "stream_pos" in table.column_names:
        stream_pos = table.column("stream_pos").to_numpy().astype(np.int64, copy=False)
    extra = {c: table.column(c).to_numpy(zero_copy_only=False) for c in columns if c not in REQUIRED_COLUMNS}
    return Shard(
        path=path,
        meta=meta,
        sample_id=sample_id,
        label=label.astype(np.int32),
        zs_logits=_fixed_list_to_numpy(table.column("zs_logits"), k),
        tta_logits=_fixed_list_to_numpy(table.column("tta_logits"), k),
        stream_pos=stream_pos,
        extra_columns=extra,
    )


def validate_shard(path: str | os.PathLike) -> list[str]:
    """All contract violations of one file as messages (empty list: valid). Non-finite logits count as a violation."""
    try:
        shard = read_shard(path)
    except ShardError as e:
        return [str(e)]
    bad = shard.nonfinite_rows()
    if bad.any():
        return [f"{path}: {int(bad.sum())} row(s) have NaN or inf in 'zs_logits' or 'tta_logits'"]
    return []


def find_shards(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand files and directories (searched recursively for *.parquet) into a sorted, de-duplicated list.

    Raises:
        ShardError: a path does not exist, or nothing was found at all.
    """
    found: dict[Path, None] = {}
    paths = list(paths)
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*.parquet")):
                if not f.name.startswith("."):
                    found[f.resolve()] = None
        elif p.is_file():
            found[p.resolve()] = None
        else:
            raise ShardError(f"{p}: no such file or directory")
    if not found:
        where = ", ".join(map(str, paths)) or "(no paths given)"
        raise ShardError(f"no shards (*.parquet) found under {where}")
    return list(found)


def group_shards(paths: Iterable[Path]) -> dict[RunKey, list[tuple[Path, ShardMeta]]]:
    """Group shard files by run from their metadata (footers only).

    Shards of one run must agree on every metadata value; a disagreement is a ShardError naming both files. An OOD
    run's class names must equal those of its in-distribution dataset's runs among the inputs (`check_ood_runs`).
    """
    groups: dict[RunKey, list[tuple[Path, ShardMeta]]] = {}
    for p in paths:
        meta = read_meta(p)
        members = groups.setdefault(meta.key, [])
        if members:
            first_path, first = members[0]
            for name in ("pretrained", "class_names", "method_config", "zs_prompts", "ood_for", "ood_dataset"):
                if getattr(first, name) != getattr(meta, name):
                    raise ShardError(
                        f"{p}: metadata {name!r} disagrees with {first_path} although both belong to run {meta.key}"
                    )
        members.append((p, meta))
    check_ood_runs(groups)
    return groups


def check_ood_runs(groups: Mapping[RunKey, Sequence[tuple[Path, ShardMeta]]]) -> None:
    """An OOD run is classified with its in-distribution dataset's class names: compare them with every run of that
    dataset among `groups` (any backbone, method, seed). Runs whose in-distribution set is absent pass.

    Raises:
        ShardError: one line naming the OOD run's file and the in-distribution run's file.
    """
    by_dataset: dict[str, tuple[Path, ShardMeta]] = {}
    for key in sorted(groups, key=str):
        by_dataset.setdefault(key.dataset, groups[key][0])
    for key in sorted(groups, key=str):
        path, meta = groups[key][0]
        if meta.ood_for is None or meta.ood_for not in by_dataset:
            continue
        id_path, id_meta = by_dataset[meta.ood_for]
        if id_meta.class_names != meta.class_names:
            diff = next((i for i, (a, b) in enumerate(zip(meta.class_names, id_meta.class_names)) if a != b),
                        min(meta.num_classes, id_meta.num_classes))
            here, there = (repr(n[diff]) if diff < len(n) else "no name" for n in (meta.class_names,
                                                                                  id_meta.class_names))
            raise ShardError(
                f"{path}: OOD run {key} must use the class names of its in-distribution set {meta.ood_for!r}, but "
                f"they differ from {id_path}'s ({meta.num_classes} vs {id_meta.num_classes} names, first difference "
                f"at index {diff}: {here} here, {there} there)")


def iter_run(members: Sequence[tuple[Path, ShardMeta]]) -> Iterator[Shard]:
    """Read the shards of one run one at a time (memory bounded by one shard)."""
    for p, _ in members:
        yield read_shard(p)


@dataclass(frozen=True)
class Completeness:
    """How much of a run its shards hold.

    Attributes:
        key: the run.
        n_rows: rows in the given shards (from the Parquet footers).
        n_expected: rows the writer announced (`min(zaec:limit, zaec:n_total)`), None when the shards carry no
            `zaec:n_total` (another writer): completeness is then unknown.
        marker: whether the writer's completion marker lies next to the shards (None: they span several folders).
        n_shards: number of shard files.
        n_total: the test set's size (`zaec:n_total`), None when not announced.
        limit: the run's `--limit` (`zaec:limit`), None for "none" or when not announced.
    """

    key: RunKey
    n_rows: int
    n_expected: int | None
    marker: bool | None
    n_shards: int
    n_total: int | None = None
    limit: int | None = None

    @property
    def known(self) -> bool:
        return self.n_expected is not None

    @property
    def interrupted(self) -> bool:
        """Fewer rows than the writer announced: an interrupted or still running run, or only some parts given."""
        return self.n_expected is not None and self.n_rows < self.n_expected

    @property
    def subset(self) -> bool:
        """A `--limit` run of fewer samples than the test set holds (docs/contract.md, "Optional keys")."""
        return self.limit is not None and self.n_total is not None and self.n_rows < self.n_total \
            and self.limit < self.n_total

    @property
    def partial(self) -> bool:
        """Not a result on the whole test set: interrupted, or a `--limit` subset."""
        return self.interrupted or self.subset

    def describe(self) -> str:
        """E.g. `32 of 64 samples in 2 shard(s), no completion marker`, or for a finished `--limit 5` run of a
        24-sample set `5 of 24 samples (--limit 5) in 1 shard(s)`."""
        if self.subset and not self.interrupted:
            return f"{self.n_rows} of {self.n_total} samples (--limit {self.limit}) in {self.n_shards} shard(s)"
        marker = {True: "", False: ", no completion marker", None: ""}[self.marker]
        text = f"{self.n_rows} of {self.n_expected} samples in {self.n_shards} shard(s){marker}"
        return text + (f", a --limit {self.limit} run of a {self.n_total}-sample set" if self.subset else "")


def announced_counts(meta: ShardMeta, path: str | os.PathLike = "<shard>") -> tuple[int | None, int | None]:
    """`(n_total, limit)` from the optional keys `zaec:n_total` / `zaec:limit` (None: absent, or limit "none").

    Raises:
        ShardError: a key that is present but not an integer (or "none" for the limit).
    """
    raw_total, raw_limit = meta.extra.get("zaec:n_total"), meta.extra.get("zaec:limit", "none")
    try:
        n_total = None if raw_total is None else int(raw_total)
        limit = None if raw_limit in ("none", "") else int(raw_limit)
    except ValueError:
        raise ShardError(f"{path}: metadata 'zaec:n_total'/'zaec:limit' must be integers (limit: or \"none\"), "
                         f"got {raw_total!r}/{raw_limit!r}") from None
    return n_total, limit


def expected_rows(meta: ShardMeta, path: str | os.PathLike = "<shard>") -> int | None:
    """`min(limit, n_total)` from the optional keys `zaec:n_total` / `zaec:limit`; None without `zaec:n_total`.

    Raises:
        ShardError: a key that is present but not an integer (or "none" for the limit).
    """
    n_total, limit = announced_counts(meta, path)
    if n_total is None:
        return None
    return n_total if limit is None else min(limit, n_total)


def run_completeness(members: Sequence[tuple[Path, ShardMeta]]) -> Completeness:
    """Rows present against rows announced for the shards of one run (footers only, no logit is read).

    The announced count is the largest any shard states (shards of a resumed run agree; a reader given a subset of
    the parts sees the shortfall); `n_total` and `limit` are read from the shard that states it.
    """
    paths = [Path(p) for p, _ in members]
    n_rows = 0
    for p in paths:
        try:
            n_rows += pq.ParquetFile(p).metadata.num_rows
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
            raise ShardError(f"{p}: not a readable Parquet file ({error_line(e)})") from None
    counts = [(expected_rows(m, p), announced_counts(m, p)) for p, m in members]
    known = [c for c in counts if c[0] is not None]
    expected, (n_total, limit) = max(known, key=lambda c: c[0]) if known else (None, (None, None))
    folders = {p.parent for p in paths}
    marker = (next(iter(folders)) / COMPLETE_MARKER).is_file() if len(folders) == 1 else None
    return Completeness(members[0][1].key, n_rows, expected, marker, len(paths), n_total, limit)
