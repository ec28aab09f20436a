"""The extraction pipeline: encode once into the feature cache, then stream the cached features through a method.

`run_extraction(method, dataset, ...)` composes the steps of `extract.run` (docs/architecture.md, "The objects of
a run"):
    1. `plan`: resolve every name (method, dataset, config overrides, anchor, model name) before any image is read,
       and refuse a method on a backbone it cannot run on (`TTAMethod.towers`) or a combination of settings it does
       not support (`TTAMethod.config_refusal`);
    2. `load_run_data`: list the test set (split files only) and fingerprint its files; the stream is a permutation
       of sample_id per (dataset, seed) (an OOD run, `RunOptions.ood_for`: both sets in one mixed list,
       `extract.run.ood`, its dataset key `<ood>@<id>`);
    3. `build_prompts` (before the model: a bad prompt file stops the run at once); then, under the run folder's
       lock (`RunDir.lock`, held to the marker), `finished_run`: reuse a finished run with the same settings (unless
       `force`), saying so, and never replace a finished longer run with a shorter one it cannot serve
       (`longer_run_refusal`); check the files the method reads beside the checkpoint (`check_external_files`:
       RLCF's reward model, COSMIC's DINOv2, DiffTPT's pipeline, PromptAlign's prompts); load the model, build the
       text prototypes (cached), the method and what it reads beyond a batch of cached features (a second image
       encoder, `attach_second_encoder`; generated views, `attach_generated`; the views' pixels or a batch's
       pixels, `attach_pixels`; class descriptions, read with the prompts), and the shard metadata;
    4. `scan_resume` / `apply_resume`: keep the valid parts of an interrupted run;
    5. `encode_pass`: fill the missing chunks of the feature cache (view 0, plus views 1..63 if the method uses them),
       then a second encoder's or the generated views' own caches;
    6. `adapt_stream`: feed the cached features in stream order, `adapt_batch` samples per `method.adapt` call (a
       method that adapts over batches of pixels: its own batch, with the batch's pixels, `attach_pixels`),
       pair each adapted logit row with the zero-shot anchor (single prompt "a photo of a {}." on view 0, or the
       method's own prompts with `anchor="method"`), and write parts of `part_size` rows (`PartWriter`) as the
       stream advances; then the completion marker.

Resume: the shards of a run are parts over fixed stream ranges [p * part_size, (p + 1) * part_size). A restarted run
keeps every valid part with the same metadata and rebuilds the method's state at the end of the kept prefix: an
online method (TDA, DPE, DLAE) replays the features of the prefix - the same `adapt` calls on the same cached
inputs -; an episodic method (the TPT family, TPS), whose only state is small (the loss scale and the count of
skipped steps), loads the state recorded in the last kept part (`zaec:method_state`, the state after the part's
last row); a method that adapts over batches of pixels loads its state saved beside the last kept part
(`state-0000p.pt`, parameters and optimiser included); a transductive method (StatA, TransCLIP, ZLaP: `consumes =
"set_features"`) gets the run's cached features (`attach_set`) and solves its units again from them, the scan keeping
only units written whole. Either way the result equals an uninterrupted run. A finished run carries a marker file
`_zaec_complete.json` next to its parts (`run_is_complete`).

Only the run itself lives here (`run_extraction`, `execute`, `plan_run` and the notes they print); each step is
imported from its home in `extract.run`, and so is every name of a step elsewhere (never through this module).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from extract.cache import TextCache, resolve_cache_dir
from extract.datasets import check_outside_dataset
from extract.defaults import DEFAULT_MAX_IMAGE_PIXELS
from extract.models import LoadedModel, load_model
from extract.run.encode import FeatureReader, encode_pass, open_feature_cache
from extract.run.options import (
    DEFAULT_ADAPT_BATCH,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_FINGERPRINT,
    DEFAULT_OUT,
    DEFAULT_PART_SIZE,
    DEFAULT_PRETRAINED,
    DEFAULT_SEED,
    MAX_CUDA_WORKERS,
    Anchor,
    ExecOptions,
    PlannedRun,
    RunError,
    RunOptions,
    check_options,
    plan,
)
from extract.run.progress import Progress, warn
from extract.run.resume import ResumePoint, ResumeScope, apply_resume, scan_resume, settings_kv
from extract.run.pixels import attach_pixels
from extract.run.diffusion import attach_generated
from extract.run.externals import check_external_files
from extract.run.reward import attach_second_encoder
from extract.run.rundata import RunData
from extract.run.rundir import RunDir
from extract.run.settings import FinishedRun, finished_run, load_run_data, longer_run_refusal, run_settings
from extract.run.setup import RunPrompts, build_method, build_prompts, prompt_features, shard_meta
from extract.run.stream import (RunState, StreamInputs, adapt_stream, attach_set, labelled_counts, replay,
                                stream_permutation)
from extract.run.writer import PartWriter, marker_doc


def plan_run(method: str, dataset: str, *, backbone: str | None, pretrained: str, seed: int,
             overrides: Mapping[str, Any] | None, anchor: str, limit: int | None,
             ood_for: str | None = None, adapt_batch: int = DEFAULT_ADAPT_BATCH,
             part_size: int = DEFAULT_PART_SIZE) -> PlannedRun:
    """`plan(RunOptions(...))` in the keyword style of `run_extraction` (resolves names; raises on any bad one,
    a `part_size` that does not hold whole adapt calls included)."""
    return plan(RunOptions.make(method, dataset, backbone=backbone, pretrained=pretrained, seed=seed,
                                overrides=overrides, anchor=anchor, limit=limit, ood_for=ood_for,
                                adapt_batch=adapt_batch, part_size=part_size))


def run_extraction(
    method: str,
    dataset: str,
    *,
    backbone: str | None = None,
    pretrained: str = DEFAULT_PRETRAINED,
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
    descriptions_dir: str | os.PathLike | None = None,
    sh_filter: bool = False,
    fingerprint: str = DEFAULT_FINGERPRINT,
    exif_transpose: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    adapt_batch: int = DEFAULT_ADAPT_BATCH,
    part_size: int = DEFAULT_PART_SIZE,
    progress: bool = True,
    wait_lock: float | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    model: LoadedModel | None = None,
    log: Callable[[str], None] | None = None,
    ood_for: str | None = None,
) -> list[Path]:
    """Run one TTA method over one dataset and write its shards; returns the shard paths in part order.

    The keyword form of `execute`: every argument is the field of the same name of `RunOptions` (what decides
    the result) or `ExecOptions` (how it executes), where each is documented. `dataset` is a dataset key, a user
    dataset's registered name (`resolve_dataset`). `model`: an already loaded model (then `backbone`,
    `pretrained` and `device` are taken from it). `log`: where one-line notes go (None: the progress console).

    Raises:
        RunError, DatasetError, ModelError, PromptError, ValueError (unknown method/config key): user errors.
    """
    options = RunOptions.make(method, dataset, backbone=backbone, pretrained=pretrained, seed=seed, limit=limit,
                              overrides=overrides, anchor=anchor, data_root=data_root, cupl_dir=cupl_dir,
                              descriptions_dir=descriptions_dir,
                              sh_filter=sh_filter, fingerprint=fingerprint, exif_transpose=exif_transpose,
                              adapt_batch=adapt_batch, part_size=part_size, ood_for=ood_for)
    execution = ExecOptions(out=out, cache_dir=cache_dir, device=device, batch_size=batch_size, workers=workers,
                            chunk_size=chunk_size, resume=resume, force=force, on_changed=on_changed,
                            progress=progress, wait_lock=wait_lock, max_image_pixels=max_image_pixels)
    return execute(options, execution, model=model, log=log)


def execute(options: RunOptions, execution: ExecOptions, *, model: LoadedModel | None = None,
            log: Callable[[str], None] | None = None) -> list[Path]:
    """Run `options` as `execution` says; returns the shard paths in part order (see the module docstring).

    Every check that needs no model (options, names, the test set and its files, the prompts) comes before the
    model loads. The run folder is locked (`RunDir.lock`) from the finished-run check to the marker, so the check
    runs again under the lock and two processes never write one run: the second waits for the first, or stops
    after `execution.wait_lock` seconds with one line naming it.
    """
    check_options(options, execution)
    if model is not None:
        options = dataclasses.replace(options, backbone=model.backbone, pretrained=model.pretrained)
    planned = plan(options)
    data = load_run_data(planned)
    last_batch = planned.last_batch_refusal(data.n_total)  # a batch of one image the method cannot adapt
    if last_batch is not None:
        raise RunError(last_batch)
    # how its images are read (never part of its identity): the loaders refuse one over the pixel limit
    data = dataclasses.replace(data, testset=dataclasses.replace(data.testset,
                                                                 max_image_pixels=execution.max_image_pixels))
    for folder, option in ((execution.out, "--out"), (resolve_cache_dir(execution.cache_dir), "--cache-dir")):
        for testset in data.listed_sets():  # files written inside a folder set change its listing
            check_outside_dataset(testset, folder, option)
    prompts = build_prompts(planned, data)  # a bad prompt file stops the run before the model loads
    run_dir = RunDir(Path(execution.out), planned.key)
    with run_dir.lock(execution.wait_lock, on_wait=lambda line: note(line, log)) as lock:
        force = execution.force
        settings = run_settings(planned, data)  # once: it reads what the method reads beside the images
        done = None if force else finished_run(run_dir, settings, options.limit)
        if done is not None and done.matches:
            note(reuse_note(planned, done, data.n_total), log)
            return list(done.parts)
        # [external files] a second model or another file the method reads (RLCF's reward model, ...): checked
        # before the policy loads, and before a finished run with other settings is refused for a file missing
        check_external_files(planned)
        if done is not None:
            _recompute_or_refuse(done, execution.on_changed, log)
            force = True
        elif not force:
            longer = longer_run_refusal(planned, run_dir, data, settings)
            if longer is not None:
                raise RunError(f"{longer}: write it elsewhere with --out (both are kept), or pass --force to "
                               "replace it")
        if model is None:
            model = load_model(options.backbone, options.pretrained, execution.device)
        parts, marker = _compute(planned, data, prompts, run_dir, execution, model, settings, force=force, log=log)
        lock.check()  # taken over while silent (a network file system without flock): never mark it complete
        run_dir.write_marker(marker)
        return parts


def _compute(planned: PlannedRun, data: RunData, prompts: RunPrompts, run_dir: RunDir, execution: ExecOptions,
             model: LoadedModel, settings: Mapping[str, Any], *, force: bool, log: Callable[[str], None] | None
             ) -> tuple[list[Path], dict[str, Any]]:
    """Everything after the model loaded: text prototypes, feature cache, method, resume, encoding and the adapt
    loop (the caller holds the run's lock). Returns the parts in order and the marker's document, which the caller
    writes."""
    options = planned.options
    cache_root = resolve_cache_dir(execution.cache_dir)
    with Progress(execution.progress) as prog:
        method_text, anchor_text = prompt_features(model, prompts, TextCache(cache_root, model.fingerprint), prog)
        perm = stream_permutation(planned.dataset, options.seed, data.n_total)
        cache = open_feature_cache(cache_root, model, planned.dataset, data.cache_key(), options.seed, perm,
                                   method_text.shape[1], execution.chunk_size)
        method = build_method(planned.method_cls, planned.config, method_text, model, backbone=planned.backbone,
                              dataset=planned.class_dataset, class_names=prompts.method_names,
                              descriptions=prompts.descriptions)
        # [second encoder] RLCF's reward model, COSMIC's DINOv2: loaded now (before any image is read), its inputs
        # attached (extract/run/reward.py)
        reward = attach_second_encoder(method, planned, model, prompts.method_names, cache_root=cache_root,
                                       testset_key=data.cache_key(), seed=options.seed, perm=perm,
                                       chunk_size=execution.chunk_size)
        # [generated views] DiffTPT: its diffusion pipeline loaded now, before any image is read
        # (extract/run/diffusion.py); the views are generated and encoded in the encoding step below
        generated = attach_generated(method, planned, model, cache_root=cache_root, testset_key=data.cache_key(),
                                     seed=options.seed, perm=perm)
        n_run = planned.n_run(data.n_total)
        method.set_stream_length(n_run)  # before its warnings are read: OnZeta warns when it must do without
        warnings = [*planned.model_notes, *prompts.method.warnings, *method.warnings]
        meta = shard_meta(planned, data, model, prompts, warnings)
        restore = planned.restore  # how a resumed run rebuilds the method's state: replay, footer or file
        unit = planned.method_cls.transductive_unit(planned.config)  # [set features] solved jointly: 0 = the run
        scope = ResumeScope(settings_kv(meta), n_run, options.part_size, execution.on_changed == "recompute",
                            _state_keys(method) if restore == "footer" else None,
                            planned.method_cls.prefix_dependence(planned.config),
                            unit=None if unit is None else (unit or n_run), adapt_batch=planned.adapt_width,
                            state_files=restore == "file")
        run_dir.remove_marker()
        # force: every part is rewritten; the old ones go only now that the model loaded
        point = scan_resume(run_dir, scope) if execution.resume and not force else ResumePoint()
        apply_resume(run_dir, point, meta)
        workers = execution.workers
        if workers is None:
            workers = min(MAX_CUDA_WORKERS, os.cpu_count() or 1) if model.device.type == "cuda" else 0
        # [pixels] TTL's views, or the batches of a method that adapts the image encoder over them (run/pixels.py)
        pixels = attach_pixels(method, planned.consumes, model, data.testset, perm, planned.policy, options.seed,
                               stop=n_run, workers=workers)
        inputs = StreamInputs(options.method, method, FeatureReader(cache, planned.policy), anchor_text,
                              model.logit_scale, model.device, perm, data.testset.labels, planned.adapt_width)
        writer = PartWriter(run_dir, meta, method, episodic=restore == "footer", part_size=options.part_size,
                            n_run=n_run, kept=[run_dir.part(p) for p in range(point.start_part)],
                            carried=point.carried, state_files=restore == "file")
        state = RunState(point.start_pos(scope), point.correct_tta, point.correct_zs,
                         labelled=labelled_counts(perm, data.testset.labels) if data.n_id is not None else None)
        _announce(planned, [*warnings, *([point.note] if point.note else [])], prog, log)
        if point.kept_note:
            _say(point.kept_note, prog, log)
        encode_pass(model, data.testset, perm, cache, planned.policy, n_run, seed=options.seed,
                    batch_size=execution.batch_size, workers=workers, progress=prog)
        for extra in (reward, generated):  # [second encoder] its features of the same views; [generated views]
            if extra is not None:  # each into its own cache
                extra.encode(data.testset, perm, n_run, seed=options.seed, batch_size=execution.batch_size,
                             workers=workers, progress=prog)
        try:
            _restore_method(inputs, point, state.position, n_run, restore, prog)
            adapt_stream(inputs, state, n_run, writer, prog.task(f"{options.method} on {planned.dataset}",
                                                                  n_run - state.position))
        finally:
            if pixels is not None:
                pixels.close()
        summary = method.summary()
        if summary:
            (log or prog.print)(f"{options.method} on {planned.dataset}: "
                                + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return writer.written, marker_doc(n_run=n_run, n_total=data.n_total, limit=options.limit,
                                      settings=settings, parts=writer.written,
                                      method_summary=method.summary(), accuracies=state.accuracies(n_run),
                                      prefix_dependence=scope.prefix_dependence, adapt_batch=planned.adapt_width)


def note(line: str, log: Callable[[str], None] | None) -> None:
    """A one-line note outside the progress display: through `log`, else on stderr (also with --quiet: it says
    which result the caller gets)."""
    if log is not None:
        log(line)
    else:
        import sys

        print(line, file=sys.stderr, flush=True)


def reuse_note(planned: PlannedRun, done: FinishedRun, n_total: int) -> str:
    """The line a reused finished run prints: that it is finished, its settings, how to redo it, and, when a
    `--limit` asks for fewer samples than it holds, that its shards hold them all."""
    o = planned.options
    n_done = int((done.run_dir.read_marker() or {}).get("n_samples", 0))
    fields = " ".join(f"{k}={v}" for k, v in planned.config_dict().items())
    line = (f"{o.method} on {planned.dataset}: already finished under {done.run_dir.path} ({n_done} of {n_total} "
            f"samples; pretrained={o.pretrained} anchor={o.anchor} seed={o.seed} {fields}); reusing it, --force "
            "recomputes it")
    n_run = planned.n_run(n_total)
    if n_done > n_run:
        line += (f". --limit {o.limit} asks for the first {n_run} samples of the stream: this finished run covers "
                 f"them ({o.method} reads neither the stream's length nor a later sample, and {n_run} ends one of "
                 f"its adapt calls) and its shards hold all {n_done} (stream_pos < {n_run} are the ones asked for); "
                 "--force would replace it with the shorter run, --out elsewhere keeps both")
    return line


def _recompute_or_refuse(done: FinishedRun, on_changed: str, log: Callable[[str], None] | None) -> None:
    """A finished run with other settings: recompute it with a note, or refuse (RunError naming what changed)."""
    where = done.run_dir.path
    if done.predates_fingerprints:
        warn(f"{where}: the finished run predates data fingerprints (it cannot be checked against the images); "
             "recomputing it", Progress(False), log)
    elif on_changed == "recompute":
        warn(f"a finished run under {where} used different settings: {done.changed()}; recomputing it",
             Progress(False), log)
    else:
        raise RunError(done.refusal())


def _state_keys(method: Any) -> tuple[str, ...]:
    """The keys an episodic method's recorded state must hold to be loaded: those its `state_dict` writes
    (`n_seen` and its state fields), the method's key aside."""
    return tuple(k for k in method.state_dict() if k != "key")


def _announce(planned: PlannedRun, warnings: list[str], prog: Progress, log: Callable[[str], None] | None) -> None:
    """Before the first image: which settings apply to a dataset without official ones, that `--adapt-batch` does
    not apply to a method with its own batch, then every warning."""
    width = planned.width_note()
    if width is not None:
        _say(width, prog, log)
    if planned.settings_note:
        fields = " ".join(f"{k}={v}" for k, v in planned.config_dict().items() if k != "episodic")
        _say(f"{planned.dataset} has no official settings; {planned.settings_note}: {fields} "
             "(change any with --set key=value)", prog, log)
    for w in warnings:
        warn(w, prog, log)


def _say(line: str, prog: Progress, log: Callable[[str], None] | None) -> None:
    """A plain line before the first image: through `log`, else the progress console (as text, not markup)."""
    if log is not None:
        log(line)
    else:
        from rich.markup import escape

        prog.print(escape(line))


def _restore_method(inputs: StreamInputs, point: ResumePoint, start_pos: int, n_run: int, restore: str,
                    prog: Progress) -> None:
    """The method's state at `start_pos` (`PlannedRun.restore`): a transductive method gets the run's cached
    features (its units start afresh at `start_pos`, a unit boundary); an online method replays the kept prefix
    (nothing when every part was kept: nothing is left to adapt); an episodic one loads the state recorded in the
    last kept part; a method that adapts over batches of pixels loads the state file saved beside it."""
    if attach_set(inputs, n_run, start_pos):
        return
    if 0 < start_pos < n_run and restore == "replay":
        replay(inputs, start_pos, prog.task(f"replaying {start_pos} samples", start_pos))
    elif 0 < start_pos < n_run and restore == "file" and point.state_file is not None:
        inputs.method.load_state_dict(_saved_state(point.state_file))
    elif start_pos and point.state is not None:
        inputs.method.load_state_dict(point.state)


def _saved_state(path: Path) -> Any:
    """The method state saved beside a kept part (its checksum already matched, `scan_resume`), read without
    unpickling code; one line naming the file when this torch cannot read it (one of another version)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as e:
        from schemas.shard import error_line

        raise RunError(f"{path}: the method state saved with the interrupted run cannot be read ({error_line(e)}); "
                       "--no-resume computes the run again") from None
