"""The extraction pipeline: encode once into the feature cache, then stream the cached features through a method.

`run_extraction(method, dataset, ...)`:
    1. resolve every name (method, dataset, config overrides, anchor, model name) before any image is read;
    2. list the test set (split files only) and fix the stream: a permutation of sample_id per (dataset, seed);
    3. skip a finished run (unless `force`); otherwise load the model, build the text prototypes (cached);
    4. encoding pass: fill the missing chunks of the feature cache (view 0, plus views 1..63 if the method uses them);
    5. adaptation pass: feed the cached features in stream order, `adapt_batch` samples per `method.adapt` call,
       pair each adapted logit row with the zero-shot anchor (single prompt "a photo of a {}." on view 0, or the
       method's own prompts with `anchor="method"`), and write shards of `part_size` rows as the stream advances.

Resume: the shards of a run are parts over fixed stream ranges [p * part_size, (p + 1) * part_size). A restarted run
keeps every valid part with the same metadata and rebuilds the method's state at the end of the kept prefix: an
online method (TDA, DPE, DLAE) replays the features of the prefix - the same `adapt` calls on the same cached
inputs -; an episodic method (the TPT family, TPS), whose only state is small (the loss scale and the count of
skipped steps), loads the state recorded in the last kept part (`zaec:method_state`, the state after the part's
last row). Either way the result equals an uninterrupted run. A finished run carries a marker file
`_zaec_complete.json` next to its parts (`run_is_complete`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from extract.augmix_device import pack_program, run_packed
from extract.cache import FeatureCache, TextCache, resolve_cache_dir, write_json_atomic
from extract.datasets import DatasetError, TestSet, get_dataset, load_testset, open_image, resolve_data_root
from extract.fingerprint import check_mode, fingerprint as data_fingerprint
from extract.models import DEFAULT_BACKBONE, LOCAL_DIR, LoadedModel, _local_dir_config, load_model
from extract.prompts import PromptSet, build_prompt_set
from extract.views import N_AUG_VIEWS, ViewGenerator, ViewPolicy, view_policy
from schemas import COMPLETE_MARKER, RunKey, ShardError, ShardMeta, read_shard, shard_dir, shard_path, write_shard

Anchor = Literal["single", "method"]
ANCHORS: tuple[str, ...] = ("single", "method")
DEFAULT_OUT = Path("data") / "shards"
#: TDA, DPE and DLAE seed their stream with 1 (spec §1.4)
DEFAULT_SEED = 1
STREAM_RULE = "numpy.random.default_rng([seed, crc32(dataset)]).permutation(N)"
# Per-part metadata that follows the stream (the method's state and summary after the part's last row): left out
# when a resumed run compares the settings of the parts on disk with its own.
PART_STATE_KEYS: frozenset[bytes] = frozenset({b"zaec:method_state", b"zaec:method_summary"})


class RunError(ValueError):
    """A user-side problem with a run (bad argument, shards on disk from a different configuration)."""


# ---------------------------------------------------------------------------------------------------------------
# small pure helpers

def stream_permutation(dataset: str, seed: int, n: int) -> np.ndarray:
    """The adaptation stream of a dataset: sample_id at each stream position, (n,) int64.

    Fixed per (dataset, seed) and identical for every method (spec §1.4 recommendation).

    Example:
        >>> stream_permutation("dtd", 1, 5).tolist() == stream_permutation("dtd", 1, 5).tolist()
        True
    """
    if seed < 0:
        raise RunError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng([int(seed), zlib.crc32(dataset.encode())])
    return rng.permutation(n).astype(np.int64)


def _marker_path(out: str | os.PathLike, key: RunKey) -> Path:
    return shard_dir(out, key) / COMPLETE_MARKER


def run_is_complete(out: str | os.PathLike, key: RunKey, *, limit: int | None = None) -> bool:
    """Whether the run `key` under `out` finished (its marker exists and every listed part is on disk).

    Args:
        out: shard root (the `--out` of the run).
        key: RunKey(backbone, dataset, method, seed) as recorded in the shards.
        limit: the `--limit` asked for; a finished full run also satisfies a limited request, a limited run
            satisfies only the same or a smaller limit.
    """
    marker = _marker_path(out, key)
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        n_done, n_total = int(info["n_samples"]), int(info["n_total"])
        parts = [marker.parent / p for p in info["parts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not all(p.is_file() for p in parts):
        return False
    wanted = n_total if limit is None else min(int(limit), n_total)
    return n_done >= wanted


def resolve_backbone_name(backbone: str | None, pretrained: str) -> str:
    """The backbone name a run records, without loading weights (for `local-dir:`, the config's `model_name`)."""
    if pretrained.startswith(LOCAL_DIR):
        d = Path(pretrained[len(LOCAL_DIR):]).expanduser()
        cfg = _local_dir_config(d)
        return backbone or cfg.get("model_name") or d.resolve().name
    return backbone or DEFAULT_BACKBONE


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """["k=v", ...] -> {k: v}; raises RunError for an item without '='."""
    out: dict[str, str] = {}
    for item in pairs:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise RunError(f"--set expects key=value, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def build_method(cls: type, config: Any, text_features: torch.Tensor, model: LoadedModel, *, backbone: str,
                 dataset: str, class_names: Sequence[str] | None = None) -> Any:
    """The one place a method object is constructed (episodic methods that tune prompts get the model as
    `text_encoder` and the class names to build their prompts from)."""
    kwargs: dict[str, Any] = {"backbone": backbone, "dataset": dataset}
    if getattr(cls, "needs_text_encoder", False):
        kwargs["text_encoder"] = model
        kwargs["class_names"] = class_names
    return cls(config, text_features, model.logit_scale, **kwargs)


def text_prototypes(model: LoadedModel, prompts: PromptSet, cache: TextCache | None) -> torch.Tensor:
    """(K, D) float32 prototypes on the model's device, from the text cache when present."""
    k = len(prompts.per_class)
    if cache is not None:
        hit = cache.get(prompts.fingerprint(), k)
        if hit is not None:
            return torch.from_numpy(hit).to(model.device)
    protos = model.text_prototypes(prompts.per_class)
    if cache is not None:
        cache.put(prompts.fingerprint(), protos.cpu().numpy())
    return protos


# ---------------------------------------------------------------------------------------------------------------
# progress display

class _Progress:
    """A rich progress bar with samples/s and running accuracy; a no-op when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._p = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            # emoji off: dataset keys such as imagenet_c:fog:3 hold rich emoji codes (":fog:")
            self._p = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[rate]}", markup=False),
                               TextColumn("{task.fields[info]}", markup=False), TimeRemainingColumn(),
                               console=Console(emoji=False))
            self._p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, description: str, total: int) -> "_Task":
        return _Task(self._p, description, total)

    def print(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg)


def _warn(message: str, progress: _Progress, log: Callable[[str], None] | None) -> None:
    """A warning always reaches the user: through `log`, the progress console, or (progress bar off, `--quiet`)
    stderr - quiet hides the progress, never a warning."""
    if log is not None:
        log(f"warning: {message}")
    elif progress.enabled:
        from rich.markup import escape
        progress.print(f"[yellow]warning:[/yellow] {escape(message)}")
    else:
        import sys
        print(f"warning: {message}", file=sys.stderr)


class _Task:
    def __init__(self, progress: Any, description: str, total: int):
        self.p = progress
        self.t0 = time.perf_counter()
        self.done = 0
        self.id = progress.add_task(description, total=total, rate="", info="") if progress is not None else None

    def advance(self, n: int, info: str = "") -> None:
        self.done += n
        if self.p is not None:
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
            self.p.update(self.id, advance=n, rate=f"{rate:,.1f} samples/s", info=info)


# ---------------------------------------------------------------------------------------------------------------
# encoding pass

class _ViewData(torch.utils.data.Dataset):
    """Item i -> (stream position, view 0 raw (1, 1, S, S, 3) uint8, views 1..63 raw (63, J, S, S, 3) uint8,
    their AugMix coefficients (63, 5) float32, None); None for a part not needed. With `device_chains` (AugMix
    on a GPU) views 1..63 are the crops (63, 1, S, S, 3), followed by the packed program and its row lists
    (`augmix_device.pack_program`).

    Loader processes do the PIL work only and send uint8 (a quarter of float32's bytes through shared and pinned
    memory); the float work (`ViewGenerator.finish`) runs in the main process on the model's device, the same
    operations giving the same bits there."""

    def __init__(self, testset: TestSet, perm: np.ndarray, jobs: list[tuple[int, bool, bool]], gen: ViewGenerator,
                 device_chains: bool = False):
        self.testset, self.perm, self.jobs, self.gen = testset, perm, jobs, gen
        self.device_chains = device_chains and gen.policy == "augmix"

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        pos, need0, need_aug = self.jobs[i]
        sid = int(self.perm[pos])
        try:
            img = open_image(self.testset.paths[sid])
        except DatasetError as e:  # passed back as text: a worker's exception would carry its traceback
            return pos, str(e), None, None, None
        # None, not empty tensors, for what is not needed: each tensor between processes costs the receiver time
        v0 = torch.from_numpy(self.gen.original_raw(img))[None, None] if need0 else None
        if need_aug and self.device_chains:  # crops and random draws only: the chains run on the device
            crops, packed, rows, lengths = pack_program(self.gen.augmix_program(img, sid))
            return pos, v0, crops, packed, (rows, lengths)
        aug, coef = self.gen.augmented_raw(img, sid) if need_aug else (None, None)
        return pos, v0, aug, coef, None


class _Batcher:
    """Encodes images in micro-batches of exactly `batch_size` (the last one of a chunk may be smaller), so a
    chunk's features depend only on the chunk.

    The micro-batch is assembled on the model's device: each sample's raw uint8 views are sent there
    (asynchronously on CUDA, from the loader's pinned memory), finished there (`ViewGenerator.finish`) and copied
    into a preallocated device buffer; the encoder runs on that buffer, and the features stay on the device until
    the chunk is finished (`finish`, one copy back). On CUDA the host therefore never waits for the encoder inside
    a chunk: it goes on receiving and copying the next samples while the GPU encodes (the copies into the buffer
    are queued on the same stream after the encoder's kernels, so a batch is never overwritten while it is read).
    Before, every micro-batch was concatenated on the host (a 154 MB copy at 256 views of 224 px), sent from
    pageable memory, and its features brought back at once, which serialised the host and the GPU. The encoder sees
    the same batches, values and shapes as before: features are unchanged.
    """

    def __init__(self, model: LoadedModel, n_images: int, batch_size: int):
        self.model, self.n_images, self.bs = model, n_images, batch_size
        self.buf: torch.Tensor | None = None  # (batch_size, 3, S, S) on the device, allocated at the first image
        self.feats: torch.Tensor | None = None  # (n_images, D) float32 on the device
        self.n_buf = 0
        self.written = 0

    def add(self, raw: torch.Tensor, coef: torch.Tensor | None, gen: ViewGenerator,
            rows: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Append V views to the stream of this part, given raw (V, J, S, S, 3) uint8 and their coefficients
        (CPU, pinned on CUDA; `ViewGenerator.augmented_raw`), sent to the device and finished there. With `rows`
        (a packed AugMix program's row lists and lengths), `raw` holds the crops (V, 1, S, S, 3) and `coef` the
        packed program (`augmix_device.pack_program`), whose chains run on the device first."""
        dev = self.model.device
        raw = raw.to(dev, non_blocking=True)
        coef = None if coef is None else coef.to(dev, non_blocking=True)
        if rows is not None:
            raw, coef = run_packed(raw, coef, rows[0].to(dev, non_blocking=True), rows[1])  # type: ignore[arg-type]
        images = gen.finish(raw, coef)
        if self.buf is None:
            self.buf = torch.empty((self.bs, *images.shape[1:]), dtype=images.dtype, device=self.model.device)
        i, v = 0, images.shape[0]
        while i < v:
            take = min(self.bs - self.n_buf, v - i)
            self.buf[self.n_buf:self.n_buf + take].copy_(images[i:i + take], non_blocking=True)
            self.n_buf += take
            i += take
            if self.n_buf == self.bs:
                self._flush()

    def _flush(self) -> None:
        n = self.n_buf
        if n == 0:
            return
        assert self.buf is not None
        feats = self.model.encode_images(self.buf[:n])
        if self.feats is None:
            self.feats = torch.empty((self.n_images, feats.shape[1]), dtype=torch.float32, device=feats.device)
        if self.written + n > self.n_images:
            raise RuntimeError(f"encoded {self.written + n} images, expected {self.n_images}")
        self.feats[self.written:self.written + n] = feats
        self.written += n
        self.n_buf = 0

    def finish(self) -> np.ndarray:
        """Encode what is pending; (n_images, D) float32 on the host."""
        self._flush()
        if self.written != self.n_images or self.feats is None:
            raise RuntimeError(f"encoded {self.written} images, expected {self.n_images}")
        return self.feats.cpu().numpy()


#: set to 0 to run AugMix's chains with Pillow in the loader processes on CUDA too (the views are the same)
DEVICE_CHAINS_ENV = "ZAEC_DEVICE_CHAINS"


def encode_pass(model: LoadedModel, testset: TestSet, perm: np.ndarray, cache: FeatureCache, policy: ViewPolicy,
                n_positions: int, *, seed: int, batch_size: int = 256, workers: int = 0,
                progress: _Progress | None = None, device_chains: bool | None = None) -> int:
    """Fill the missing feature-cache chunks covering stream positions [0, n_positions). Returns samples encoded.

    View 0 is always stored; views 1..63 only for the multi-view policies. `device_chains` (default: on CUDA, unless
    $ZAEC_DEVICE_CHAINS is 0) runs AugMix's operation chains on the model's device (`extract.augmix_device`, the
    same pixels) instead of in the loader processes, which then only crop and draw.
    """
    parts: tuple[str, ...] = ("view0",) if policy == "single" else ("view0", policy)
    missing = cache.missing(parts, n_positions)
    if not missing:
        return 0
    gen = ViewGenerator(model.preprocess, policy, seed=seed)
    # per chunk: the rows to encode ([keep, need) of each missing part) - only the positions the run needs
    plans = [_chunk_plan(cache, c, miss, n_positions, batch_size) for c, miss in missing]
    jobs: list[tuple[int, bool, bool]] = []
    for c, start, need, keep in plans:
        lo = min(keep.values())
        jobs += [(start + i, i >= keep.get("view0", need), i >= keep.get(policy, need)) for i in range(lo, need)]
    if device_chains is None:  # ZAEC_DEVICE_CHAINS=0 keeps the chains in the loader processes (same views)
        device_chains = model.device.type == "cuda" and os.environ.get(DEVICE_CHAINS_ENV, "1") != "0"
    loader = torch.utils.data.DataLoader(_ViewData(testset, perm, jobs, gen, device_chains), batch_size=None,
                                         shuffle=False, num_workers=workers, pin_memory=model.device.type == "cuda")
    task = (progress or _Progress(False)).task(f"encoding {testset.key} ({policy})", len(jobs))
    it = iter(loader)
    for c, start, need, keep in plans:
        shapes = {part: cache.expected_shape(part, c, need - k) for part, k in keep.items()}  # type: ignore[arg-type]
        batchers = {part: _Batcher(model, math.prod(shape[:-1]), batch_size) for part, shape in shapes.items()}
        for _ in range(need - min(keep.values())):
            pos, x0, xa, coef, rows = next(it)
            if isinstance(x0, str):  # an image the loader cannot read (named in the message)
                raise DatasetError(x0)
            if x0 is not None:
                batchers["view0"].add(x0, None, gen)
            if xa is not None:
                batchers[policy].add(xa, coef, gen, rows)
            task.advance(1)
        for part, b in batchers.items():
            feats = b.finish().reshape(shapes[part])
            k = keep[part]
            cpart: Any = part
            new = feats if k == 0 else np.concatenate([np.asarray(cache.load(cpart, c)[:k], np.float32), feats])
            cache.save(cpart, c, new)
    return len(jobs)


def _chunk_plan(cache: FeatureCache, c: int, miss: tuple[str, ...], n_positions: int, batch_size: int
                ) -> tuple[int, int, int, dict[str, int]]:
    """(chunk, first stream position, rows needed, {missing part: rows of its stored prefix kept}).

    A stored prefix is kept up to its last micro-batch boundary (a multiple of `batch_size` images from the chunk's
    start; a part with V images per position keeps a multiple of batch_size / gcd(V, batch_size) positions) and the
    rest re-encoded, so the extended chunk is encoded in the same micro-batches as a chunk encoded whole."""
    start, stop = cache.chunk_range(c)
    need = min(stop, n_positions) - start
    keep = {}
    for part in miss:
        per_pos = 1 if part == "view0" else N_AUG_VIEWS
        step = batch_size // math.gcd(per_pos, batch_size)
        keep[part] = min(cache.rows(part, c), need) // step * step  # type: ignore[arg-type]
    return c, start, need, keep


class _FeatureReader:
    """Reads (B, V, D) float32 view features for stream ranges from the cache (keeps the current chunk open)."""

    def __init__(self, cache: FeatureCache, policy: ViewPolicy):
        self.cache, self.policy = cache, policy
        self._chunk = -1
        self._data: tuple[np.ndarray, np.ndarray | None] | None = None

    def _load(self, c: int) -> tuple[np.ndarray, np.ndarray | None]:
        if c != self._chunk:
            v0 = self.cache.load("view0", c)
            aug = None if self.policy == "single" else self.cache.load(self.policy, c)  # type: ignore[arg-type]
            self._chunk, self._data = c, (v0, aug)
        assert self._data is not None
        return self._data

    def get(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        pos = start
        while pos < stop:
            c = pos // self.cache.chunk_size
            c0, c1 = self.cache.chunk_range(c)
            hi = min(stop, c1)
            v0, aug = self._load(c)
            a = np.array(v0[pos - c0:hi - c0], dtype=np.float32)[:, None, :]  # a writable copy
            if aug is not None:
                a = np.concatenate([a, np.array(aug[pos - c0:hi - c0], dtype=np.float32)], axis=1)
            pieces.append(a)
            pos = hi
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


# ---------------------------------------------------------------------------------------------------------------
# the run

@dataclass(frozen=True)
class _Plan:
    """Everything resolved before the first image is read."""

    method_cls: type
    config: Any
    spec_key: str
    backbone: str
    policy: ViewPolicy
    key: RunKey
    #: for a dataset without official settings: which settings apply (printed at the start, kept in the shards)
    settings_note: str = ""


def plan_run(method: str, dataset: str, *, backbone: str | None, pretrained: str, seed: int,
             overrides: Mapping[str, Any] | None, anchor: str, limit: int | None) -> _Plan:
    """Resolve method, dataset, backbone name, config (+ overrides) and the view policy; raises on any bad name."""
    from extract.methods import apply_overrides, get_method

    cls = get_method(method)
    spec = get_dataset(dataset)
    if anchor not in ANCHORS:
        raise RunError(f"unknown anchor {anchor!r}; available: {', '.join(ANCHORS)}")
    if limit is not None and limit < 1:
        raise RunError(f"--limit must be >= 1, got {limit}")
    if seed < 0:
        raise RunError(f"seed must be >= 0, got {seed}")
    name = resolve_backbone_name(backbone, pretrained)
    unseen = spec.hparams_from is None  # a user's dataset: the method's documented settings for unseen data
    config = cls.unseen_config(name) if unseen else cls.default_config(spec.hparams_from, name)
    if overrides:
        config = apply_overrides(config, dict(overrides))
    try:
        policy = view_policy(int(config.n_views), bool(config.augmix))
    except ValueError as e:
        raise RunError(f"{method}: {e}") from None
    note = ""
    if unseen:
        from extract.prompts import USER_PROMPT_POLICIES
        if config.prompts not in USER_PROMPT_POLICIES or config.cupl:
            raise RunError(f"dataset {spec.key!r} has no per-dataset templates or CuPL sentences: prompts must be "
                           f"one of {', '.join(USER_PROMPT_POLICIES)} and cupl false, got prompts={config.prompts}, "
                           f"cupl={config.cupl}")
        changes = "".join(f", {k}={v}" for k, v in cls.unseen_changes.items())
        note = f"{method}'s settings for unseen data: {cls.unseen_like}'s row{changes}"
        note += f", then --set {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""
    return _Plan(cls, config, spec.key, name, policy, RunKey(name, spec.key, method, int(seed)), note)


def _config_dict(config: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _settings_kv(meta: ShardMeta) -> dict[bytes, bytes]:
    """A part's metadata without the keys that follow the stream (`PART_STATE_KEYS`)."""
    return {k: v for k, v in meta.to_kv().items() if k not in PART_STATE_KEYS}


def _part_meta(meta: ShardMeta, method: Any, episodic: bool) -> ShardMeta:
    """The metadata of a part just finished: the run's, plus the method's summary and, for an episodic method, its
    state (plain numbers) after the part's last row, which a resumed run loads."""
    extra = {**meta.extra, "zaec:method_summary": json.dumps(method.summary(), sort_keys=True)}
    if episodic:
        extra["zaec:method_state"] = json.dumps(method.state_dict(), sort_keys=True)
    return dataclasses.replace(meta, extra=extra)


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Fail fast on an output folder that cannot be written: `path` (or the folder it would be created in) must not
    be a file and its nearest existing folder must be writable. Checked before any image is read.

    Raises:
        RunError: one line naming the option, the path and what is wrong.
    """
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    where = f"{option} {path}" + ("" if probe == path else f" (to be created in {probe})")
    if probe.exists() and not probe.is_dir():
        raise RunError(f"{where}: {probe} is a file, expected a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunError(f"{where}: folder {probe} is not writable; choose another with {option}")
    return path


def check_run_options(*, batch_size: int, workers: int | None, out: str | os.PathLike,
                      cache_dir: str | os.PathLike | None) -> None:
    """The numeric options and the output folders of a run, checked before any image is read (RunError)."""
    if batch_size < 1:
        raise RunError(f"--batch-size must be a positive integer, got {batch_size}")
    if workers is not None and workers < 0:
        raise RunError(f"--workers must be >= 0, got {workers}")
    check_output_dir(out, "--out")
    check_output_dir(resolve_cache_dir(cache_dir), "--cache-dir" if cache_dir is not None else "the cache folder "
                     "($ZAEC_CACHE_DIR or data/cache; set --cache-dir)")


def check_finite_logits(method: str, tta: np.ndarray, zs: np.ndarray, sample_ids: np.ndarray, start: int) -> None:
    """Stop the run at the first adapted or zero-shot logit row holding NaN or inf, naming the method, the sample
    and its stream position (the run is then never marked complete).

    Args:
        tta, zs: (B, K) logits of stream positions [start, start + B); sample_ids: (B,) their sample ids.
    """
    bad = ~(np.isfinite(tta).all(axis=1) & np.isfinite(zs).all(axis=1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        which = "adapted" if not np.isfinite(tta[i]).all() else "zero-shot"
        raise RunError(f"method {method!r} produced non-finite {which} logits for sample_id {int(sample_ids[i])} at "
                       f"stream position {start + i} ({int(bad.sum())} of {len(bad)} row(s) in this batch); the run "
                       "is not marked complete; check the --set values")


def _data_identity(testset: TestSet, data_root: str | os.PathLike | None, mode: str) -> dict[str, str]:
    """The resolved data root (for a user's `folder:`/`split:` dataset, which needs none: its own folder) and the
    data fingerprint of the test set's image files (`extract.fingerprint`)."""
    own = get_dataset(testset.key).ref is not None
    root = testset.dataset_dir if own else resolve_data_root(data_root)
    return {"data_root": str(Path(root).resolve()), "data_fingerprint": data_fingerprint(testset, mode)}


def data_identity(dataset: str, data_root: str | os.PathLike | None = None, *, sh_filter: bool = False,
                  mode: str = "stat") -> dict[str, str]:
    """`{"samples": ..., "data_root": ..., "data_fingerprint": ...}` as a run of `dataset` would record them in its
    settings (for checks outside a run, e.g. a sweep deciding whether a finished run still matches its sample list,
    class names and images)."""
    testset = load_testset(dataset, data_root, sh_filter=sh_filter)
    return {"samples": testset.fingerprint(), **_data_identity(testset, data_root, mode)}


def _cache_key(testset: TestSet, data: Mapping[str, str]) -> str:
    """The test-set part of the feature cache key: sample list, data root and data fingerprint (16 hex)."""
    raw = "\n".join((testset.fingerprint(), data["data_root"], data["data_fingerprint"]))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


#: what a changed setting of a finished run means, for the refusal message
_SETTING_HINTS = {"data_fingerprint": "the image files changed (size, modification time or content)",
                  "data_root": "another data root", "samples": "another split or class list"}


def _predates_data_fingerprint(old: Any, new: Mapping[str, Any]) -> bool:
    """A finished run recorded before data fingerprints existed, with otherwise the same settings: its data cannot be
    verified, so it is recomputed rather than served or refused."""
    return (isinstance(old, dict) and "data_fingerprint" not in old
            and {k: v for k, v in new.items() if k not in ("data_fingerprint", "data_root")} == old)


def _settings_differ(sdir: Path, old: Any, new: Mapping[str, Any]) -> str:
    """One line saying which settings of the finished run under `sdir` differ from this run's."""
    old = old if isinstance(old, dict) else {}
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    why = ", ".join(f"{k} ({_SETTING_HINTS[k]})" if k in _SETTING_HINTS else k for k in keys)
    return (f"a finished run under {sdir} used different settings: {why}; use --force to recompute it or write "
            "elsewhere with --out")


#: metadata keys that may differ between the kept parts of a resumed run and the run resuming them
_RESTAMPED_KEYS = (b"zaec:limit",)


def _meta_diff(old: Mapping[bytes, bytes], new: Mapping[bytes, bytes]) -> list[str]:
    """Sorted metadata keys whose values differ, ignoring those a resumed run rewrites (`_RESTAMPED_KEYS`)."""
    return sorted(k.decode() for k in set(old) | set(new)
                  if k not in _RESTAMPED_KEYS and old.get(k) != new.get(k))


def _restamp(shard: Any, meta: ShardMeta) -> Path:
    """Rewrite a kept part with this run's metadata (its rows unchanged), so every part of a run agrees on
    `zaec:limit` and a reader knows how many samples the run announces."""
    return write_shard(shard.path, meta, shard.sample_id, shard.label, shard.zs_logits, shard.tta_logits,
                       stream_pos=shard.stream_pos)


def _existing_parts(sdir: Path) -> list[Path]:
    return sorted(sdir.glob("part-*.parquet")) if sdir.is_dir() else []


def run_extraction(
    method: str,
    dataset: str,
    *,
    backbone: str | None = None,
    pretrained: str = "openai",
    data_root: str | os.PathLike | None = None,
    out: str | os.PathLike = DEFAULT_OUT,
    seed: int = DEFAULT_SEED,
    device: str | None = None,
    limit: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    anchor: Anchor = "single",
    resume: bool = True,
    force: bool = False,
    on_changed: Literal["refuse", "recompute"] = "refuse",
    cache_dir: str | os.PathLike | None = None,
    cupl_dir: str | os.PathLike | None = None,
    sh_filter: bool = False,
    fingerprint: str = "stat",
    batch_size: int = 256,
    workers: int | None = None,
    chunk_size: int = 512,
    adapt_batch: int = 64,
    part_size: int = 4096,
    progress: bool = True,
    model: LoadedModel | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Path]:
    """Run one TTA method over one dataset and write its shards; returns the shard paths in part order.

    Args:
        method: method key (`extract.methods.REGISTRY`).
        dataset: dataset key (`extract.datasets.REGISTRY`), a user dataset's name (`resolve_dataset`), or a
            `folder:PATH` / `split:FILE.json` reference (named after its folder).
        backbone: open_clip model name; None = `ViT-B-16`, or with `pretrained="local-dir:DIR"` the directory's
            model name.
        pretrained: tag (`openai`), checkpoint file or `local-dir:DIR`.
        data_root: datasets folder (None: $ZAEC_DATA_ROOT, else ./data).
        out: shard root; shards go to `<out>/backbone=../dataset=../method=../seed=../part-00000.parquet`.
        seed: orders the stream and seeds the augmented views.
        device: torch device (None: cuda if available).
        limit: only the first `limit` stream positions.
        overrides: config field -> value (strings converted to the field type), as `--set`.
        anchor: "single" = zero-shot logits from "a photo of a {}." on view 0; "method" = the method's own prompts.
        resume: keep valid parts of an interrupted run (default); False recomputes every part.
        force: recompute even a finished run.
        on_changed: what to do with a finished run whose settings differ from this run's (another method config,
            data root, image files, ...): "refuse" (RunError naming what changed; the command line's behaviour) or
            "recompute" it with a note (for a caller that owns its output folder, such as the demo).
        cache_dir: feature cache root (None: $ZAEC_CACHE_DIR, else data/cache).
        cupl_dir: CuPL prompt files (None: $ZAEC_CUPL_DIR).
        sh_filter: the TDA file-listing quirk on ImageNet-A/-R/-Sketch/-V2 (spec §13.9), off by default.
        fingerprint: how the image files are fingerprinted for the feature cache and the finished-run check:
            "stat" (size and modification time of each file) or "content" (sha256 of each file).
        batch_size: images per encoder call. workers: image-loading processes (None: 0 on CPU, up to 16 on CUDA).
        chunk_size: samples per cache chunk. adapt_batch: samples per `method.adapt` call.
        part_size: rows per shard (a multiple of `adapt_batch`).
        progress: show the rich progress bar.
        model: an already loaded model (then `backbone`, `pretrained`, `device` are taken from it).
        log: where one-line notes go (None: the progress console, or nowhere).

    Returns:
        Paths of the run's shards.

    Raises:
        RunError, DatasetError, ModelError, PromptError, ValueError (unknown method/config key): user errors.
    """
    if part_size % adapt_batch:
        raise RunError(f"part_size ({part_size}) must be a multiple of adapt_batch ({adapt_batch})")
    check_run_options(batch_size=batch_size, workers=workers, out=out, cache_dir=cache_dir)
    if on_changed not in ("refuse", "recompute"):
        raise RunError(f"on_changed must be 'refuse' or 'recompute', got {on_changed!r}")
    if model is not None:
        backbone, pretrained = model.backbone, model.pretrained
    plan = plan_run(method, dataset, backbone=backbone, pretrained=pretrained, seed=seed, overrides=overrides,
                    anchor=anchor, limit=limit)
    dataset = plan.spec_key  # a `folder:`/`split:` reference -> the dataset's canonical name
    check_mode(fingerprint)
    testset = load_testset(dataset, data_root, sh_filter=sh_filter)
    data = _data_identity(testset, data_root, fingerprint)
    n_total = len(testset)
    n_run = n_total if limit is None else min(limit, n_total)
    out = Path(out)
    sdir = shard_dir(out, plan.key)
    # what a finished run must match to be reused without --force
    settings = {"method_config": _config_dict(plan.config), "pretrained": pretrained, "anchor": anchor,
                "sh_filter": bool(sh_filter), "samples": testset.fingerprint(), **data}
    marker = sdir / COMPLETE_MARKER
    if not force and run_is_complete(out, plan.key, limit=limit):
        info = json.loads(marker.read_text(encoding="utf-8"))
        old = info.get("settings")
        if old == settings:
            return [sdir / p for p in info["parts"]]
        if _predates_data_fingerprint(old, settings):
            _warn(f"{sdir}: the finished run predates data fingerprints (it cannot be checked against the images); "
                  "recomputing it", _Progress(False), log)
        elif on_changed == "recompute":
            _warn(_settings_differ(sdir, old, settings).split("; use --force")[0] + "; recomputing it",
                  _Progress(False), log)
        else:
            raise RunError(_settings_differ(sdir, old, settings))
        force = True

    if model is None:
        model = load_model(backbone, pretrained, device)
    cache_root = resolve_cache_dir(cache_dir)
    config = plan.config
    # the names the method's prompts are built from (TPS has its own ImageNet list)
    method_names = plan.method_cls.method_class_names(dataset, testset.class_names, testset.imagenet_indices)
    method_prompts = build_prompt_set(dataset, method_names, policy=config.prompts, cupl=bool(config.cupl),
                                      cupl_dir=cupl_dir)
    if anchor == "single":
        anchor_prompts = build_prompt_set(dataset, testset.class_names, policy="single")
    else:
        anchor_prompts = method_prompts
    warnings = list(method_prompts.warnings)
    text_cache = TextCache(cache_root, model.fingerprint)
    method_text = text_prototypes(model, method_prompts, text_cache)
    anchor_text = method_text if anchor_prompts is method_prompts else text_prototypes(model, anchor_prompts,
                                                                                        text_cache)
    perm = stream_permutation(dataset, seed, n_total)
    cache = FeatureCache(cache_root, model.fingerprint, dataset, _cache_key(testset, data), int(seed), n_total,
                         int(method_text.shape[1]), model.cache_dtype,
                         stream_fp=f"{zlib.crc32(perm.tobytes()):08x}", chunk_size=chunk_size)

    method_obj = build_method(plan.method_cls, config, method_text, model, backbone=plan.backbone, dataset=dataset,
                              class_names=method_names)
    warnings += method_obj.warnings
    zs_desc = {"anchor": anchor, **anchor_prompts.describe(), "view": 0, "logit_scale": model.logit_scale}
    extra = {
        "zaec:warnings": json.dumps(warnings),
        "zaec:prompts": json.dumps(method_prompts.describe(), sort_keys=True),
        "zaec:views": plan.policy,
        "zaec:logit_scale": repr(model.logit_scale),
        "zaec:stream": STREAM_RULE,
        "zaec:n_total": str(n_total),
        "zaec:limit": "none" if limit is None else str(int(limit)),
        "zaec:layout": testset.layout,
        "zaec:data_root": data["data_root"],
        "zaec:data_fingerprint": data["data_fingerprint"],
    }
    if tuple(method_names) != tuple(testset.class_names):
        extra["zaec:method_class_names"] = json.dumps(list(method_names))
    if testset.imagenet_indices is not None and len(testset.imagenet_indices) != 1000:
        extra["zaec:imagenet_indices"] = json.dumps(list(testset.imagenet_indices))
    for k, v in testset.notes.items():
        extra[f"zaec:{k}"] = v
    if plan.settings_note:
        extra["zaec:method_settings"] = plan.settings_note
    meta = ShardMeta(backbone=plan.backbone, pretrained=model.pretrained, dataset=dataset, method=method, seed=seed,
                     class_names=testset.class_names, method_config=_config_dict(config), zs_prompts=zs_desc,
                     extra=extra)
    meta_kv = _settings_kv(meta)
    episodic = bool(getattr(config, "episodic", False))

    n_parts = -(-n_run // part_size)
    marker.unlink(missing_ok=True)
    start_part = 0
    kept_state: dict[str, Any] | None = None  # an episodic method's state after the last kept part
    kept_stats = [0, 0]  # correct tta, correct zs in the kept parts
    if resume and not force:  # (force: every part is rewritten; the old ones go only now that the model loaded)
        for p in range(n_parts):
            path = shard_path(out, plan.key, p)
            if not path.is_file():
                break
            try:
                sh = read_shard(path)
            except ShardError:
                break
            if b"zaec:data_fingerprint" not in sh.meta.to_kv():  # written before data fingerprints: recompute
                break
            kv = _settings_kv(sh.meta)
            diff = _meta_diff(kv, meta_kv)
            if diff and on_changed == "recompute":
                break
            if diff:
                raise RunError(f"{path} was written by a run with different settings ({', '.join(diff)}); "
                               f"use --force to overwrite it or write elsewhere with --out")
            lo, hi = p * part_size, min((p + 1) * part_size, n_run)
            if sh.stream_pos is None or not np.array_equal(sh.stream_pos, np.arange(lo, hi)):
                break
            if episodic:  # its state after this part: recompute from here when it is missing or not this part's
                try:
                    state = json.loads(sh.meta.extra["zaec:method_state"])
                    usable = int(state["n_seen"]) == hi and all(f in state for f in method_obj._state_fields)
                except (KeyError, ValueError, TypeError):
                    usable = False
                if not usable:
                    break
                kept_state = state
            if kv != meta_kv:  # a full part of a run with another --limit: same rows, new footer (own state kept)
                own = {k: v for k, v in sh.meta.extra.items() if k.encode() in PART_STATE_KEYS}
                _restamp(sh, dataclasses.replace(meta, extra={**meta.extra, **own}))
            kept_stats[0] += int((sh.tta_logits.argmax(1) == sh.label).sum())
            kept_stats[1] += int((sh.zs_logits.argmax(1) == sh.label).sum())
            start_part = p + 1
    for p in _existing_parts(sdir):  # parts this run will rewrite, or stale parts of a longer run
        idx = int(p.stem.split("-")[1])
        if idx >= start_part:
            p.unlink()

    dev = model.device
    if workers is None:
        workers = min(16, os.cpu_count() or 1) if dev.type == "cuda" else 0
    reader = _FeatureReader(cache, plan.policy)
    start_pos = min(start_part * part_size, n_run)
    written = [shard_path(out, plan.key, p) for p in range(start_part)]

    with _Progress(progress) as prog:
        say = log or prog.print
        from rich.markup import escape
        if plan.settings_note:  # a dataset without official settings: say which apply before the first image
            fields = " ".join(f"{k}={v}" for k, v in _config_dict(config).items() if k != "episodic")
            line = (f"{dataset} has no official settings; {plan.settings_note}: {fields} "
                    "(change any with --set key=value)")
            say(line if log is not None else escape(line))
        for w in warnings:
            _warn(w, prog, log)
        encode_pass(model, testset, perm, cache, plan.policy, n_run, seed=seed, batch_size=batch_size,
                    workers=workers, progress=prog)
        if 0 < start_pos < n_run and not episodic:  # (all parts kept: nothing left to adapt, no replay)
            task = prog.task(f"replaying {start_pos} samples", start_pos)
            for s in range(0, start_pos, adapt_batch):
                e = min(s + adapt_batch, start_pos)
                method_obj.adapt(torch.from_numpy(reader.get(s, e)).to(dev))
                task.advance(e - s)
        elif start_pos and kept_state is not None:
            method_obj.load_state_dict(kept_state)
        task = prog.task(f"{method} on {dataset}", n_run - start_pos)
        correct = list(kept_stats)
        rows: dict[str, list[np.ndarray]] = {k: [] for k in ("sid", "label", "zs", "tta", "pos")}
        for s in range(start_pos, n_run, adapt_batch):
            e = min(s + adapt_batch, n_run)
            feats = torch.from_numpy(reader.get(s, e)).to(dev)  # (B, V, D), L2-normalised
            tta = method_obj.adapt(feats)
            tta = (tta.detach().float().cpu().numpy() if isinstance(tta, torch.Tensor)
                   else np.asarray(tta, np.float32))
            zs = (model.logit_scale * feats[:, 0] @ anchor_text.T).float().cpu().numpy()
            sid = perm[s:e]
            check_finite_logits(method, tta, zs, sid, s)
            label = testset.labels[sid]
            correct[0] += int((tta.argmax(1) == label).sum())
            correct[1] += int((zs.argmax(1) == label).sum())
            for k, v in (("sid", sid), ("label", label), ("zs", zs), ("tta", tta), ("pos", np.arange(s, e))):
                rows[k].append(v)
            task.advance(e - s, f"acc {100 * correct[0] / e:5.1f}% (zero-shot {100 * correct[1] / e:5.1f}%)")
            if e % part_size == 0 or e == n_run:
                p = (e - 1) // part_size
                cat = {k: np.concatenate(v) for k, v in rows.items()}
                written.append(write_shard(shard_path(out, plan.key, p), _part_meta(meta, method_obj, episodic),
                                           cat["sid"], cat["label"], cat["zs"], cat["tta"], stream_pos=cat["pos"]))
                rows = {k: [] for k in rows}
        summary = method_obj.summary()
        if summary:
            say(f"{method} on {dataset}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    write_json_atomic(marker, {"n_samples": n_run, "n_total": n_total, "limit": limit, "settings": settings,
                               "parts": [p.name for p in written], "method_summary": method_obj.summary(),
                               "accuracy": correct[0] / max(n_run, 1),
                               "zero_shot_accuracy": correct[1] / max(n_run, 1)})
    return written
