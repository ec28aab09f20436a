"""The encoding pass: fill the feature cache with the image features of stream positions [0, n) (view 0, plus views
1..63 for the multi-view policies), and read them back in stream order (`FeatureReader`)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import traceback
import zlib
from typing import Any, Sequence

import numpy as np
import torch

from extract.augmix_device import pack_program, packed_rows, run_packed
from extract.cache import CacheError, FeatureCache
from extract.datasets import DatasetError, TestSet, open_image
from extract.defaults import WARN_IMAGE_PIXELS
from extract.models import LoadedModel
from extract.run.progress import Progress
from extract.views import AUGMIX_MAX_DEPTH, N_AUG_VIEWS, ViewGenerator, ViewPolicy


#: stream positions per loader item in a single-view pass (one (32, 1, S, S, 3) uint8 tensor per item): every item
#: costs the main process time to receive (about 0.3 ms per tensor), to pin and to launch its copy and float work,
#: which with one image per item capped a 16-process single-view pass near 800 images/s on an H100 machine
SINGLE_VIEW_ITEM = 32
#: AugMix samples whose device chains the main thread launches in one call (`augmix_device.run_chains` over all
#: their views): the launches are per call, about 940 for one sample, so the main thread's time per sample falls
#: about this many times (16.7 ms per sample on an H100 machine with one sample per call)
CHAIN_SAMPLES = 16


class _ViewData(torch.utils.data.Dataset):
    """Item i = a group of stream positions (`items[i]`: (position, needs view 0, needs views 1..63) each) ->
    (positions, view 0 raw (n0, 1, S, S, 3) uint8 of the positions that need it, views 1..63 raw (63 n, J, S, S, 3)
    uint8 of those that need them, their extra, the (file, pixels) of images over `WARN_IMAGE_PIXELS`); None for a
    part not needed, and the message in place of view 0 when an image cannot be read (or is over the test set's
    `max_image_pixels`). The extra: the AugMix coefficients (63 n, 5) float32, or, with `device_chains`
    (AugMix on a GPU), the packed programs (63 n, W) float64 (`augmix_device.pack_program`) while views 1..63 are
    the crops (J = 1).

    Loader processes do the PIL work only and send uint8 (a quarter of float32's bytes through shared and pinned
    memory); the float work (`ViewGenerator.finish`) runs in the main process on the model's device, the same
    operations giving the same bits there. Few tensors per item, each many images: every tensor between processes
    costs the receiving process time, whatever its size."""

    def __init__(self, testset: TestSet, perm: np.ndarray, items: list[list[tuple[int, bool, bool]]],
                 gen: ViewGenerator, device_chains: bool = False):
        self.testset, self.perm, self.items, self.gen = testset, perm, items, gen
        self.device_chains = device_chains and gen.policy == "augmix"

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        jobs = self.items[i]
        positions = [pos for pos, _, _ in jobs]
        n0 = sum(need0 for _, need0, _ in jobs)
        s = self.gen.size
        # view 0 written straight into shared memory in a loader process (no copy when the item is sent)
        v0 = torch.empty((n0, 1, s, s, 3), dtype=torch.uint8) if n0 else None
        if v0 is not None and torch.utils.data.get_worker_info() is not None:
            v0.share_memory_()
        k, aug, extra, large = 0, [], [], []
        for pos, need0, need_aug in jobs:
            sid = int(self.perm[pos])
            try:
                img = open_image(self.testset.paths[sid], exif_transpose=self.testset.exif_transpose,
                                 max_pixels=self.testset.max_image_pixels)
            except DatasetError as e:  # passed back as text: a worker's exception would carry its traceback
                return positions, str(e), None, None, None
            if img.width * img.height > WARN_IMAGE_PIXELS:  # reported by the main process (`encode_pass`)
                large.append((str(self.testset.paths[sid]), img.width * img.height))
            if need0:
                v0[k, 0] = torch.from_numpy(self.gen.original_raw(img))  # type: ignore[index]
                k += 1
            if need_aug and self.device_chains:  # crops and random draws only: the chains run on the device
                crops, packed, _, _ = pack_program(self.gen.augmix_program(img, sid))
                aug.append(crops)
                extra.append(packed)
            elif need_aug:
                raw, coef = self.gen.augmented_raw(img, sid)
                aug.append(raw)
                extra.append(coef)
        # None, not empty tensors, for what is not needed: each tensor between processes costs the receiver time
        return positions, v0, _cat(aug), _cat(extra), large or None


def _cat(parts: list[Any]) -> Any:
    """One tensor of the parts (the part itself when alone: no copy), None when there are none (or all None)."""
    if not parts or parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pinned(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`x` ready for an asynchronous copy to `dev`: on CUDA in pinned memory (pinned here if it is not: an
    asynchronous copy from pageable memory first waits for the stream to drain, which would make the host wait for
    the encoder)."""
    if dev.type == "cuda" and x.device.type == "cpu" and not x.is_pinned():
        return x.pin_memory()
    return x


def _to_device(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`x` on `dev` without making the host wait (`_pinned`)."""
    return _pinned(x, dev).to(dev, non_blocking=True)


class _Batcher:
    """Encodes images in micro-batches of exactly `batch_size` (the last one of a chunk may be smaller), so a
    chunk's features depend only on the chunk.

    The micro-batch is assembled on the model's device: each item's raw uint8 views are sent there
    (asynchronously on CUDA, from the loader's pinned memory), finished there (`ViewGenerator.finish`) and copied
    into a preallocated device buffer; the encoder runs on that buffer, and the features stay on the device until
    the chunk is finished (`finish`, one copy back). On CUDA the host therefore never waits for the encoder inside
    a chunk: it goes on receiving and copying the next items while the GPU encodes (the copies into the buffer
    are queued on the same stream after the encoder's kernels, so a batch is never overwritten while it is read).
    AugMix programs (`add_program`) are gathered until `CHAIN_SAMPLES` samples' views are there, and their chains
    run in one call. The encoder sees the same batches, values and shapes as before: features are unchanged.
    """

    def __init__(self, model: LoadedModel, n_images: int, batch_size: int, gen: ViewGenerator):
        self.model, self.n_images, self.bs, self.gen = model, n_images, batch_size, gen
        self.buf: torch.Tensor | None = None  # (batch_size, 3, S, S) on the device, allocated at the first image
        self.feats: torch.Tensor | None = None  # (n_images, D) float32 on the device
        self.n_buf = 0
        self.written = 0
        # AugMix programs waiting for their chains: crops and programs on the device, programs on the host (rows)
        self.crops: torch.Tensor | None = None
        self.programs: torch.Tensor | None = None
        self.host_programs: list[torch.Tensor] = []
        self.n_prog = 0

    def add(self, raw: torch.Tensor, coef: torch.Tensor | None) -> None:
        """Append V views to the stream of this part, given raw (V, J, S, S, 3) uint8 and their coefficients
        (CPU, pinned on CUDA; `ViewGenerator.augmented_raw`), sent to the device and finished there."""
        dev = self.model.device
        self._append(self.gen.finish(_to_device(raw, dev), None if coef is None else _to_device(coef, dev)))

    def add_program(self, crops: torch.Tensor, packed: torch.Tensor) -> None:
        """Append V AugMix views given by their crops (V, 1, S, S, 3) uint8 and packed programs (V, W) float64
        (`augmix_device.pack_program`; CPU, pinned on CUDA): copied into the device's group buffers now, their
        chains run with the group's (`_run_programs`)."""
        v, dev = crops.shape[0], self.model.device
        if self.crops is None or self.n_prog + v > self.crops.shape[0]:
            self._run_programs()
            if self.crops is None or v > self.crops.shape[0]:
                cap = max(v, CHAIN_SAMPLES * N_AUG_VIEWS)
                self.crops = torch.empty((cap, *crops.shape[1:]), dtype=crops.dtype, device=dev)
                self.programs = torch.empty((cap, packed.shape[1]), dtype=packed.dtype, device=dev)
        assert self.programs is not None
        # into the group buffers, in stream order after the previous group's chains that read them
        self.crops[self.n_prog:self.n_prog + v].copy_(_pinned(crops, dev), non_blocking=True)
        self.programs[self.n_prog:self.n_prog + v].copy_(_pinned(packed, dev), non_blocking=True)
        self.host_programs.append(packed)
        self.n_prog += v
        if self.n_prog == self.crops.shape[0]:
            self._run_programs()

    def _run_programs(self) -> None:
        """The chains of every waiting AugMix view in one call, then their float work and the micro-batches."""
        n = self.n_prog
        if n == 0:
            return
        assert self.crops is not None and self.programs is not None
        host = _cat(self.host_programs)
        rows, lengths = packed_rows(host, AUGMIX_MAX_DEPTH)  # on the host: the device never waits for them
        images, coef = run_packed(self.crops[:n], self.programs[:n], _to_device(rows, self.model.device), lengths)
        self.host_programs, self.n_prog = [], 0
        self._append(self.gen.finish(images, coef))

    def _append(self, images: torch.Tensor) -> None:
        """Finished views (V, 3, S, S) on the device into the micro-batch buffer, encoding every full batch."""
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
        self._run_programs()
        self._flush()
        if self.written != self.n_images or self.feats is None:
            raise RuntimeError(f"encoded {self.written} images, expected {self.n_images}")
        return self.feats.cpu().numpy()


#: set to 0 to run AugMix's chains with Pillow in the loader processes on CUDA too (the views are the same)
DEVICE_CHAINS_ENV = "ZAEC_DEVICE_CHAINS"


def encode_pass(model: LoadedModel, testset: TestSet, perm: np.ndarray, cache: FeatureCache, policy: ViewPolicy,
                n_positions: int, *, seed: int, batch_size: int = 256, workers: int = 0,
                progress: Progress | None = None, device_chains: bool | None = None) -> int:
    """Fill the missing feature-cache chunks covering stream positions [0, n_positions). Returns samples encoded.

    View 0 is always stored; views 1..63 only for the multi-view policies. `device_chains` (default: on CUDA, unless
    $ZAEC_DEVICE_CHAINS is 0) runs AugMix's operation chains on the model's device (`extract.augmix_device`, the
    same pixels) instead of in the loader processes, which then only crop and draw. A loader item carries
    `SINGLE_VIEW_ITEM` positions in a single-view pass, one position otherwise (63 views already).
    """
    parts: tuple[str, ...] = ("view0",) if policy == "single" else ("view0", policy)
    missing = cache.missing(parts, n_positions)
    if not missing:
        return 0
    gen = ViewGenerator(model.preprocess, policy, seed=seed)
    # per chunk: the rows to encode ([keep, need) of each missing part) - only the positions the run needs
    plans = [_chunk_plan(cache, c, miss, n_positions, batch_size) for c, miss in missing]
    per_item = SINGLE_VIEW_ITEM if policy == "single" else 1
    items: list[list[tuple[int, bool, bool]]] = []  # items never straddle chunks
    for c, start, need, keep in plans:
        jobs = [(start + i, i >= keep.get("view0", need), i >= keep.get(policy, need))
                for i in range(min(keep.values()), need)]
        items += [jobs[i:i + per_item] for i in range(0, len(jobs), per_item)]
    if device_chains is None:  # ZAEC_DEVICE_CHAINS=0 keeps the chains in the loader processes (same views)
        device_chains = model.device.type == "cuda" and os.environ.get(DEVICE_CHAINS_ENV, "1") != "0"
    loader = torch.utils.data.DataLoader(_ViewData(testset, perm, items, gen, device_chains), batch_size=None,
                                         shuffle=False, num_workers=workers, pin_memory=model.device.type == "cuda",
                                         worker_init_fn=_ignore_sigint if workers else None)
    n_jobs = sum(len(item) for item in items)
    task = (progress or Progress(False)).task(f"encoding {testset.key} ({policy})", n_jobs)
    it = _start_loader(loader)
    large: list[tuple[str, int]] = []
    try:
        for plan in plans:
            _encode_chunk(it, plan, cache, model, gen, policy, batch_size, task, device_chains, large)
        if large and progress is not None:  # Pillow's warning, once and through the run's printer (not --quiet)
            progress.print(large_images_note(large, testset.max_image_pixels))
    except KeyboardInterrupt:
        _quiet_fd_server()
        raise
    finally:
        # on Ctrl-C or an error, stop the loader processes now, while the interpreter is whole, not when the
        # iterator is collected at exit (the traceback keeps it alive), which printed cut-off tracebacks
        getattr(it, "_shutdown_workers", lambda: None)()
    return n_jobs


def _quiet_fd_server() -> None:
    """On Ctrl-C, before the loader processes are stopped: drop the traceback that multiprocessing's fd-passing
    server thread (`resource_sharer`, which hands a batch's shared memory to this process) prints when a process
    stops in the middle of a hand-over. It reports through `sys.excepthook`, after the clean message; every other
    exception still reaches the previous hook. The process is ending: the hook stays."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        frames = traceback.extract_tb(tb)
        if any(f.name == "_serve" and f.filename.endswith("resource_sharer.py") for f in frames):
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def _ignore_sigint(worker_id: int) -> None:
    """A loader process ignores Ctrl-C: the terminal sends SIGINT to the whole process group, and an interrupted
    loader process prints its own traceback; the main process alone stops the run and shuts them down. Its
    `_quiet_peer_gone` hook keeps the one traceback a loader process can still print then."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.excepthook = _quiet_peer_gone


def _quiet_peer_gone(args: threading.ExceptHookArgs, default: Any = threading.__excepthook__) -> None:
    """A loader process's thread hook: the thread that hands a batch's shared memory to the main process
    (`multiprocessing.resource_sharer`, serving torch's file-descriptor sharing) fails with a reset connection when
    the main process was interrupted in the middle of taking one; the main process says so itself, so that thread's
    traceback is dropped. Any other exception of any thread is printed as usual."""
    gone = issubclass(args.exc_type, (ConnectionResetError, BrokenPipeError, EOFError))
    if gone and args.exc_traceback is not None and any(
            f.f_code.co_filename.endswith("resource_sharer.py") for f, _ in traceback.walk_tb(args.exc_traceback)):
        return
    default(args)


def _start_loader(loader: torch.utils.data.DataLoader) -> Any:
    """`iter(loader)` with SIGINT blocked in this thread while the loader processes start (they inherit the mask
    until `_ignore_sigint` runs), so none of them can be interrupted before it ignores SIGINT.

    A Ctrl-C in that window is held and raised once they have started: blocking it in this thread is not enough,
    since another thread of the process (torch's) may take the signal, and Python then raises KeyboardInterrupt
    in whatever this thread runs next, which during a fork is an at-fork callback (logging's `_releaseLock`) that
    swallows it ("Exception ignored"), so the run went on to the end as if never interrupted.
    """
    if not loader.num_workers:
        return iter(loader)
    held: list[int] = []
    swap = threading.current_thread() is threading.main_thread()  # signal handlers belong to the main thread
    old_handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if swap else None
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        it = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if swap:
            signal.signal(signal.SIGINT, old_handler)
    if held:
        getattr(it, "_shutdown_workers", lambda: None)()
        raise KeyboardInterrupt
    return it


def large_images_note(large: Sequence[tuple[str, int]], limit: int) -> str:
    """One line for the images over Pillow's warning threshold that a pass read (Pillow warns of a possible
    decompression bomb there; the run's own limit, `--max-image-pixels`, refuses what it must)."""
    from rich.markup import escape

    path, pixels = max(large, key=lambda x: x[1])
    bound = f"the limit is {limit:,} (--max-image-pixels)" if limit else "no limit (--max-image-pixels 0)"
    return escape(f"note: {len(large)} image(s) of more than {WARN_IMAGE_PIXELS:,} pixels were read (Pillow's "
                  f"decompression-bomb warning threshold), the largest {path} ({pixels:,} pixels); {bound}")


def _encode_chunk(it: Any, plan: tuple[int, int, int, dict[str, int]], cache: FeatureCache, model: LoadedModel,
                  gen: ViewGenerator, policy: ViewPolicy, batch_size: int, task: Any, device_chains: bool,
                  large: list[tuple[str, int]]) -> None:
    """Encode the rows `plan` (`_chunk_plan`) calls for from the loader iterator `it` and store the chunk; the
    images over `WARN_IMAGE_PIXELS` are added to `large`."""
    c, start, need, keep = plan
    shapes = {part: cache.expected_shape(part, c, need - k) for part, k in keep.items()}  # type: ignore[arg-type]
    batchers = {part: _Batcher(model, math.prod(shape[:-1]), batch_size, gen) for part, shape in shapes.items()}
    todo = need - min(keep.values())
    while todo > 0:
        positions, x0, xa, extra, big = next(it)
        if isinstance(x0, str):  # an image the loader cannot read (named in the message)
            raise DatasetError(x0)
        large += big or ()
        if x0 is not None:
            batchers["view0"].add(x0, None)
        if xa is not None and device_chains:
            batchers[policy].add_program(xa, extra)
        elif xa is not None:
            batchers[policy].add(xa, extra)
        todo -= len(positions)
        task.advance(len(positions))
    for part, b in batchers.items():
        feats = b.finish().reshape(shapes[part])
        k = keep[part]
        cpart: Any = part
        new = feats if k == 0 else np.concatenate([np.asarray(cache.load(cpart, c)[:k], np.float32), feats])
        cache.save(cpart, c, new)


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


class FeatureReader:
    """Reads (B, V, D) float32 view features for stream ranges from the cache (keeps the current chunk open)."""

    def __init__(self, cache: FeatureCache, policy: ViewPolicy):
        self.cache, self.policy = cache, policy
        self._chunk = -1
        self._data: tuple[np.ndarray, np.ndarray | None] | None = None

    def _load(self, c: int) -> tuple[np.ndarray, np.ndarray | None]:
        if c != self._chunk:
            v0 = self._finite("view0", c)
            aug = None if self.policy == "single" else self._finite(self.policy, c)
            self._chunk, self._data = c, (v0, aug)
        assert self._data is not None
        return self._data

    def _finite(self, part: str, c: int) -> np.ndarray:
        """Chunk `c` of `part`; CacheError naming the file when a feature is NaN or inf (a damaged cache file, not
        the method's settings: the encoder's features are L2-normalised, hence finite)."""
        arr = self.cache.load(part, c)  # type: ignore[arg-type]
        finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
        if not finite.all():
            row = int(np.flatnonzero(~finite)[0])
            raise CacheError(f"{self.cache.path(part, c)}: the cached features of stream position "  # type: ignore
                             f"{self.cache.chunk_range(c)[0] + row} ({int((~finite).sum())} row(s) in all) are not "
                             "finite; the cache file is damaged: delete it to encode those images again")
        return arr

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


def open_feature_cache(cache_root: os.PathLike, model: LoadedModel, dataset: str, testset_key: str, seed: int,
                       perm: np.ndarray, dim: int, chunk_size: int) -> FeatureCache:
    """The feature cache of one (model, dataset, test set, stream): `testset_key` is `RunData.cache_key()`, `perm`
    the stream (its crc32 is part of the key), `dim` the feature width."""
    return FeatureCache(cache_root, model.fingerprint, dataset, testset_key, int(seed), len(perm), int(dim),
                        model.cache_dtype, stream_fp=f"{zlib.crc32(perm.tobytes()):08x}", chunk_size=chunk_size)
