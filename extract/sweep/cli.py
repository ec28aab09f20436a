"""`zaec-sweep`: run the grid methods x datasets x backbones x seeds as jobs (SLURM or one machine) via submitit.

\b
    zaec-sweep --methods zero-shot,tda,dpe,dlae --datasets all --backbones ViT-B-16,RN50 --seeds 1
               [--executor local|slurm] [--partition P --gpus-per-job 1 --timeout-min N ...] [--dry-run]
    zaec-sweep --config grid.toml [any option above overrides the file]
    zaec-sweep status [--out DIR]         the manifest as a table, states refreshed from the jobs
    zaec-sweep retry  [--out DIR]         resubmit the failed and lost runs only

Every name is resolved before anything is submitted. Runs whose shards are complete (the extractor's own
`RunDir.is_complete`) are skipped, so re-running the same command submits only what is missing, failed or lost. Runs
that share a feature cache - same backbone, weights, dataset, view policy and seed - form one group; SLURM gets one
array task per group, the local executor packs the groups into `--local-jobs` processes. The manifest lives in
`<out>/_sweep/manifest.json`; calibrate the results with `zaec-calibrate <out>`.

A user error ends in one line on stderr and exit status 2; `run --wait` and `retry --wait` exit with 1 when a run
failed.
"""


from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, List, Mapping, NoReturn, Optional, Sequence

import typer

from calibrate.cli_errors import USER_ERRORS, fail, run_app
from extract.sweep.cost import cost_notes, plan_title
from extract.sweep.grid import plan_frame
from extract.sweep.errors import SweepError
from extract.sweep.grid import (
    Grid,
    Group,
    class_names_files,
    expand_grid,
    group_runs,
    pack_groups,
    parse_seeds,
    split_list,
)
from extract.sweep.manifest import Manifest, locked_manifest, manifest_frame, sweep_dir
from extract.defaults import (
    CACHE_DIR_ENV,
    CUPL_DIR_ENV,
    DESCRIPTIONS_DIR_ENV,
    DATA_ROOT_ENV,
    DEFAULT_BACKBONE,
    DEFAULT_CACHE_DIR,
    DEFAULT_DATA_ROOT,
    DEFAULT_MAX_IMAGE_PIXELS,
)
from extract.run.options import (
    ADAPT_BATCH_HELP,
    ANCHORS,
    DEFAULT_ADAPT_BATCH,
    DEFAULT_ANCHOR,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_FINGERPRINT,
    DEFAULT_OUT,
    DEFAULT_PART_SIZE,
    DEFAULT_PRETRAINED,
    DEFAULT_SEED,
    MAX_CUDA_WORKERS,
    PART_SIZE_HELP,
)
from extract.sweep.runspec import (
    RunSpec,
    check_data,
    check_backbones,
    check_finished_settings,
    check_longer_runs,
    check_models,
    default_backbones,
    is_complete,
    sweep_exec_fields,
    sweep_run_fields,
)
from extract.sweep.state import ACTIVE_STATES, RETRY_STATES, STATES
from extract.sweep.submit import ExecOptions, check_setup, sbatch_preview, submit_and_record
from extract.sweep.track import refresh, split_runs

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None)

PROG = "zaec-sweep"
COMMANDS = ("run", "status", "retry")
#: seconds between two refreshes while waiting
POLL_S = 2.0


# ---------------------------------------------------------------------------------------------------------------
# rendering (rich) of the polars frames built in extract.sweep.cost and extract.sweep.manifest

STATE_STYLE = {"done": "green", "failed": "bold red", "lost": "bold magenta", "running": "cyan", "pending": "yellow"}


def render_manifest(manifest: Manifest, console: Any, *, only: str | None = None) -> None:
    from rich.table import Table

    df = manifest_frame(manifest)
    if only:
        df = df.filter(df["state"] == only)
    t = Table(title=f"sweep {manifest.out}", show_lines=False)
    for h in ("backbone", "dataset", "method", "seed", "job", "state", "error / shards"):
        t.add_column(h, overflow="fold")
    for r in df.iter_rows(named=True):
        style = STATE_STYLE.get(r["state"], "")
        detail = r["error"] if r["state"] in RETRY_STATES else _relative(r["shard_dir"], manifest.out)
        t.add_row(r["backbone"], r["dataset"], r["method"], str(r["seed"]), r["job_id"] or "-",
                  f"[{style}]{r['state']}[/{style}]" if style else r["state"], _escape(detail))
    console.print(t)
    counts = manifest_frame(manifest)["state"].value_counts(sort=True)
    summary = ", ".join(f"{n} {s}" for s, n in counts.iter_rows())
    console.print(f"{len(manifest.rows)} run(s): {summary or 'none'}", highlight=False)


def _relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def render_plan(groups: Sequence[Group], skipped: Sequence[RunSpec], active: Sequence[str], opts: ExecOptions,
                out: Path, console: Any, left_out: Sequence[str] = ()) -> None:
    """The dry run of `run` and `retry`: refuses what the submission refuses before sbatch runs (`check_setup`),
    then prints the plan table, its notes and the SLURM script or the local packing."""
    from rich.table import Table

    if groups and opts.executor == "slurm":
        check_setup(opts.slurm_setup)
    df = plan_frame(groups, opts.cost())
    t = Table(title=plan_title([r for g in groups for r in g.runs], opts.cost()))
    for h in ("group (backbone/dataset/views/seed)", "methods", "images", "views", "est. GPU-h"):
        t.add_column(h, justify="right" if h in ("images", "views", "est. GPU-h") else "left")
    for r in df.iter_rows(named=True):
        t.add_row(r["group"], r["methods"], f"{r['images']:,}", f"{r['views']:,}", fmt_hours(r["gpu_hours"]))
    console.print(t)
    n_runs = int(df["runs"].sum()) if len(df) else 0
    total = float(df["gpu_hours"].sum()) if len(df) else 0.0
    console.print(f"{n_runs} run(s) to submit in {len(groups)} group(s), about {fmt_hours(total)} GPU-hours; "
                  f"{len(skipped)} complete (skipped); {len(active)} already submitted and still active",
                  highlight=False)
    for note in cost_notes([r for g in groups for r in g.runs]):
        console.print(f"note: {note}", markup=False, highlight=False)
    say_left_out(left_out, console)
    if not groups:
        return
    if opts.executor == "slurm":
        console.print(f"SLURM: one job array of {len(groups)} task(s); sbatch script:", highlight=False)
        console.print(sbatch_preview(opts, groups, sweep_dir(out) / "submitit"), markup=False, highlight=False,
                      soft_wrap=True)
    else:
        packs = pack_groups(groups, opts.local_jobs, opts.cost())
        for i, pack in enumerate(packs):
            hours = sum(g.estimate_hours(opts.cost()) for g in pack)
            ids = [g.group_id for g in pack]
            shown = ", ".join(ids[:4]) + (f", ... ({len(ids) - 4} more)" if len(ids) > 4 else "")
            console.print(f"local job {i}: {len(pack)} group(s) one after the other, about {fmt_hours(hours)} h: "
                          f"{shown}", markup=False, highlight=False)


def fmt_hours(h: float) -> str:
    return f"{h:.2f}" if h < 10 else f"{h:.0f}"


# ---------------------------------------------------------------------------------------------------------------
# the three commands as functions (the typer commands below parse options and call these)

def wait_for(out: Path, run_ids: Sequence[str], live: Mapping[str, Any], console: Any,
             poll_s: float = POLL_S) -> Manifest:
    """Refresh until none of `run_ids` is pending or running, printing each change (and once, a note on SLURM
    accounting when it does not answer); returns the final manifest."""
    said: set[str] = set()
    while True:
        notes: list[str] = []
        with locked_manifest(out) as m:
            for run_id, state, err in refresh(m, live, notes):
                line = f"{state:8s} {run_id}" + (f": {err}" if err else "")
                console.print(line, markup=False, highlight=False)
        _say_notes(notes, said, console)
        active = [r for r in run_ids if m.rows.get(r, {}).get("state") in ACTIVE_STATES]
        if not active:
            return m
        time.sleep(poll_s)


def say_left_out(left_out: Sequence[str], console: Any) -> None:
    """One note per (method, backbone) pair the grid left out (`expand_grid`: the method cannot run there)."""
    for why in left_out:
        console.print(f"note: left out of the grid: {why}", markup=False, highlight=False, soft_wrap=True)


def _say_notes(notes: Sequence[str], said: set[str], console: Any) -> None:
    for note in notes:
        if note not in said:
            said.add(note)
            console.print(f"note: {note}", markup=False, highlight=False)


def sweep_run(runs: Sequence[RunSpec], opts: ExecOptions, out: Path, *, dry_run: bool, wait: bool,
              console: Any, left_out: Sequence[str] = ()) -> int:
    """Skip complete and still-active runs, group the rest, submit, record; optionally wait. Returns an exit code.
    `left_out`: the (method, backbone) pairs the grid left out (`expand_grid`), one note each."""
    out = Path(out).resolve()
    if dry_run:  # states refreshed in memory only; nothing is written
        manifest = Manifest.load(out)
        refresh(manifest)
        skipped, active, todo = split_runs(runs, manifest)
        check_finished_settings(skipped)
        render_plan(group_runs(todo), skipped, active, opts, out, console, left_out)
        return 0
    check_finished_settings([r for r in runs if is_complete(r)])
    with locked_manifest(out) as manifest:
        refresh(manifest)
        skipped, active, todo = split_runs(runs, manifest, record_done=True)
        groups = group_runs(todo)
        live = submit_and_record(manifest, groups, opts) if groups else {}
    console.print(f"{len(todo)} run(s) submitted in {len(groups)} job group(s) ({opts.executor}); "
                  f"{len(skipped)} complete (skipped); {len(active)} already submitted and still active",
                  highlight=False)
    say_left_out(left_out, console)
    if not wait or not todo:
        if todo:
            console.print(f"follow with: zaec-sweep status --out {out}", highlight=False)
        return 0
    return _finish(out, [r.run_id for r in todo], live, console)


def _finish(out: Path, run_ids: Sequence[str], live: Mapping[str, Any], console: Any) -> int:
    m = wait_for(out, run_ids, live, console)
    render_manifest(m, console)
    failed = [r for r in run_ids if m.rows[r]["state"] in RETRY_STATES]
    if failed:
        console.print(f"{len(failed)} run(s) failed or lost; see the error column, then: zaec-sweep retry --out "
                      f"{out}", highlight=False)
        return 1
    return 0


def sweep_retry(out: Path, overrides: Mapping[str, Any], *, dry_run: bool, wait: bool | None, console: Any) -> int:
    """Resubmit the failed and lost runs of the manifest (regrouped by feature cache), with the recorded executor
    settings updated by `overrides`."""
    out = Path(out).resolve()
    with locked_manifest(out, must_exist=True) as manifest:
        refresh(manifest)
        failed = [manifest.spec(k) for k, r in sorted(manifest.rows.items()) if r.get("state") in RETRY_STATES]
        opts = ExecOptions.from_dict({**manifest.executor, **overrides})
        if not failed:
            console.print("nothing to retry: no failed or lost run in the manifest", highlight=False)
            return 0
        check_longer_runs(failed)
        groups = group_runs(failed)
        if dry_run:
            render_plan(groups, [], [], opts, out, console)
            return 0
        live = submit_and_record(manifest, groups, opts)
    console.print(f"{len(failed)} failed or lost run(s) resubmitted in {len(groups)} job group(s) ({opts.executor})",
                  highlight=False)
    if wait is None:
        wait = opts.executor == "local"
    if not wait:
        return 0
    return _finish(out, [r.run_id for r in failed], live, console)


# ---------------------------------------------------------------------------------------------------------------
# configuration file

GRID_KEYS = ("methods", "datasets", "backbones", "seeds", "pretrained", "set", "class_names")
#: one value for every run: the options of `RunOptions` and the runner's `ExecOptions` that are no grid dimension
#: (derived from their fields, so a new option of the extractor is a key here without an edit)
RUN_KEYS = tuple(sweep_run_fields().values()) + tuple(sweep_exec_fields().values())
SWEEP_KEYS = ("skip_data_check", "wait")
EXEC_KEYS = tuple(f.name for f in dataclasses.fields(ExecOptions))
CONFIG_KEYS = GRID_KEYS + RUN_KEYS + SWEEP_KEYS + EXEC_KEYS


def load_config(path: Path) -> dict[str, Any]:
    """Read a TOML grid file: top-level keys named like the long options (`methods`, `datasets`, `partition`,
    `timeout_min`, ...; lists as TOML arrays or comma-separated strings)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise SweepError("reading --config needs Python >= 3.11 or `pip install tomli`") from None
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(doc) - set(CONFIG_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(CONFIG_KEYS)}")
    return doc


def _pick(cli: Any, cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """CLI value when given, else the config file's, else the default."""
    if cli is not None and cli != [] and cli != ():
        return cli
    return cfg.get(key, default)


def _as_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def _exec_options(cfg: Mapping[str, Any], cli: Mapping[str, Any]) -> ExecOptions:
    values = {k: _pick(cli.get(k), cfg, k) for k in EXEC_KEYS}
    values = {k: v for k, v in values.items() if v is not None}
    if "slurm_setup" in values:
        values["slurm_setup"] = _as_tuple(values["slurm_setup"])
    try:
        return ExecOptions(**values)
    except TypeError as e:
        raise SweepError(f"bad executor setting: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# typer commands (user errors: one line through calibrate.cli_errors.fail)

def _console() -> Any:
    from rich.console import Console

    return Console(emoji=False)


_EXEC_HELP = "executor setting (see `zaec-sweep run --help`)"
_OOD_FOR_HELP = ("out-of-distribution runs: every dataset of --datasets is mixed into the stream of the "
                 "in-distribution set KEY (e.g. imagenet), or of a folder:PATH / split:FILE.json set ([NAME=]..., its "
                 "class names by --class-names NAME=FILE)")
_WAIT_LOCK_HELP = ("while another process writes one of the runs: a job waits at most SECONDS, then fails that run "
                   "(0: at once) [default: waits until it finishes]")
_MAX_IMAGE_PIXELS_HELP = ("an image of more pixels fails its run with one line naming it (Pillow's decompression-bomb "
                          f"guard); 0: no limit [default: {DEFAULT_MAX_IMAGE_PIXELS:,}]")


@app.command()
def run(
    methods: Optional[str] = typer.Option(None, help="comma-separated method keys (zero-shot,tda,dpe,dlae), or all "
                                                     "(every registered method)"),
    datasets: Optional[str] = typer.Option(None, help="comma-separated dataset keys, 'all' (the 15 of the paper), "
                                                      "'imagenet_c' (its 75 keys), folder:PATH, split:FILE.json, "
                                                      "NAME=folder:PATH"),
    class_names: List[str] = typer.Option([], "--class-names", help="NAME=FILE: class names of the folder:/split: "
                                                                    "dataset NAME, one per line or a JSON list, in "
                                                                    "label order (repeatable)"),
    backbones: Optional[str] = typer.Option(
        None, help="comma-separated open_clip names (ViT-B-16,RN50), each optionally NAME=PRETRAINED; may be "
                   f"omitted with --pretrained local-dir:DIR [default: {DEFAULT_BACKBONE}]"),
    seeds: Optional[str] = typer.Option(None, help=f"comma-separated seeds [default: {DEFAULT_SEED}]"),
    pretrained: Optional[str] = typer.Option(None, help="weights of every backbone: tag, file, or local-dir:DIR "
                                                        f"[default: {DEFAULT_PRETRAINED}]"),
    set_: List[str] = typer.Option([], "--set", help="config override: key=value (all methods) or "
                                                     "method.key=value (repeatable)"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with the same keys as the options; "
                                                                 "options given here override it"),
    out: Optional[Path] = typer.Option(None, help=f"shard root [default: {DEFAULT_OUT}]; the manifest goes to "
                                                  "OUT/_sweep/"),
    data_root: Optional[Path] = typer.Option(None, help=f"datasets folder [default: ${DATA_ROOT_ENV}, else "
                                                        f"./{DEFAULT_DATA_ROOT}]"),
    cache_dir: Optional[Path] = typer.Option(None, help=f"feature cache [default: ${CACHE_DIR_ENV}, else "
                                                        f"{DEFAULT_CACHE_DIR}]; must be visible to every job"),
    cupl_dir: Optional[Path] = typer.Option(None, help=f"CuPL prompt files [default: ${CUPL_DIR_ENV}]"),
    descriptions_dir: Optional[Path] = typer.Option(None, help="class-description files <dataset>.json (AWT) "
                                                                f"[default: ${DESCRIPTIONS_DIR_ENV}]"),
    limit: Optional[int] = typer.Option(None, help="only the first N samples of each stream (quick looks)"),
    ood_for: Optional[str] = typer.Option(None, "--ood-for", metavar="KEY", help=_OOD_FOR_HELP),
    anchor: Optional[str] = typer.Option(None, help=f"zero-shot anchor: {' or '.join(ANCHORS)} "
                                                    f"[default: {DEFAULT_ANCHOR}]"),
    tda_sh_filter: Optional[bool] = typer.Option(None, "--tda-sh-filter/--no-tda-sh-filter",
                                                 help="reproduce TDA's listing quirk on ImageNet-A/R/Sketch/V2 "
                                                      "(drops file names containing 'sh') [default: off]"),
    fingerprint: Optional[str] = typer.Option(None, help="how image files are fingerprinted: stat or content "
                                                         f"[default: {DEFAULT_FINGERPRINT}]"),
    exif_transpose: Optional[bool] = typer.Option(None, "--exif-transpose/--no-exif-transpose",
                                                  help="turn photos as their EXIF orientation says [default: off]"),
    adapt_batch: Optional[int] = typer.Option(None, help=f"{ADAPT_BATCH_HELP} [default: {DEFAULT_ADAPT_BATCH}]"),
    part_size: Optional[int] = typer.Option(None, help=f"{PART_SIZE_HELP} [default: {DEFAULT_PART_SIZE}]"),
    device: Optional[str] = typer.Option(None, help="torch device inside each job [default: cuda if available]"),
    workers: Optional[int] = typer.Option(None, help="image-loading processes per job [default: up to "
                                                     f"{MAX_CUDA_WORKERS} on CUDA, 0 on CPU]"),
    batch_size: Optional[int] = typer.Option(None, help=f"images per encoder call [default: {DEFAULT_BATCH_SIZE}]"),
    chunk_size: Optional[int] = typer.Option(None, help=f"samples per feature-cache chunk [default: "
                                                        f"{DEFAULT_CHUNK_SIZE}]"),
    wait_lock: Optional[float] = typer.Option(None, metavar="SECONDS", help=_WAIT_LOCK_HELP),
    max_image_pixels: Optional[int] = typer.Option(None, metavar="N", help=_MAX_IMAGE_PIXELS_HELP),
    executor: Optional[str] = typer.Option(None, help="local (this machine) or slurm [default: local]"),
    partition: Optional[str] = typer.Option(None, help="SLURM partition"),
    account: Optional[str] = typer.Option(None, help="SLURM account"),
    qos: Optional[str] = typer.Option(None, help="SLURM quality of service"),
    constraint: Optional[str] = typer.Option(None, help="SLURM node constraint"),
    gpus_per_job: Optional[int] = typer.Option(None, help="GPUs per job [default: 1]"),
    cpus_per_job: Optional[int] = typer.Option(None, help="CPUs per SLURM job [default: 10]"),
    mem_gb: Optional[float] = typer.Option(None, help="memory per SLURM job in GB"),
    timeout_min: Optional[int] = typer.Option(None, help="time limit per job in minutes [default: SLURM twice the "
                                                         "longest group's estimate; local 30 days]"),
    array_parallelism: Optional[int] = typer.Option(None, help="SLURM array tasks running at once [default: 256]"),
    slurm_setup: List[str] = typer.Option([], "--slurm-setup", help="shell line run before each SLURM job, e.g. "
                                                                    "'source .venv/bin/activate' (repeatable)"),
    local_jobs: Optional[int] = typer.Option(None, help="local processes side by side [default: 1]"),
    rates: Optional[Path] = typer.Option(None, "--rates", help="JSON of `python -m tools.bench_gpu --json` (make "
                                                               "bench-gpu): price the plan with its measured rates"),
    wait: Optional[bool] = typer.Option(None, "--wait/--no-wait", help="wait for the jobs and show the result "
                                                                       "[default: wait with local, not with slurm]"),
    skip_data_check: bool = typer.Option(False, "--skip-data-check",
                                         help="do not list the datasets before submitting (or in a dry run)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (runs, groups, GPU-hours); submit nothing"),
) -> None:
    """Run a grid (the default command: `zaec-sweep --methods ...` is `zaec-sweep run --methods ...`)."""
    _run_command(dict(locals()))  # every option by its parameter name, None (or []) where not given


def _run_command(given: Mapping[str, Any]) -> NoReturn:
    """The `run` command on its options (`given`, by parameter name): exits with `_run_grid`'s code, 2 and one
    line for a user error, 130 with a note on resuming when interrupted."""
    console = _console()
    try:
        code = _run_grid(given, console)
    except USER_ERRORS as e:
        fail(PROG, e, full=True)
    except KeyboardInterrupt:
        console.print("interrupted: the manifest keeps the submitted runs; `zaec-sweep status` shows what "
                      "finished, the same command or `zaec-sweep retry` resumes the rest", highlight=False)
        raise typer.Exit(130)
    raise typer.Exit(code)


def _run_grid(given: Mapping[str, Any], console: Any) -> int:
    """The `run` command on its options (`given`, by parameter name) over the config file's; returns the exit code."""
    cfg = load_config(given["config"]) if given["config"] is not None else {}
    left_out: list[str] = []
    runs, opts, out_dir = grid_runs(given, cfg, left_out)
    pending = [r for r in runs if not is_complete(r)]
    # a dry run checks what a submission checks: what this machine can check never waits for a job to fail on it
    check_backbones(pending)
    check_models(pending)
    check_longer_runs(pending)
    if not (given["skip_data_check"] or cfg.get("skip_data_check", False)):
        check_data(pending)
    do_wait = _pick(given["wait"], cfg, "wait")
    if do_wait is None:
        do_wait = opts.executor == "local"
    return sweep_run(runs, opts, out_dir, dry_run=given["dry_run"], wait=bool(do_wait), console=console,
                     left_out=left_out)


def grid_runs(given: Mapping[str, Any], cfg: Mapping[str, Any], left_out: list[str] | None = None
              ) -> tuple[list[RunSpec], ExecOptions, Path]:
    """(resolved runs, executor settings, shard root) of the `run` command's options (`given`, by parameter name;
    None or [] where not given) over the config file's `cfg`. Options not given anywhere are the extractor's
    defaults (`extract.run.options`). `left_out` receives the (method, backbone) pairs left out (`expand_grid`)."""

    def pick(key: str, default: Any = None) -> Any:
        return _pick(given[key if key != "set" else "set_"], cfg, key, default)

    grid = Grid(
        methods=split_list(pick("methods"), "--methods"),
        datasets=split_list(pick("datasets"), "--datasets"),
        backbones=split_list(pick("backbones"), "--backbones"),
        seeds=parse_seeds(pick("seeds", str(DEFAULT_SEED))),
        pretrained=str(pick("pretrained", DEFAULT_PRETRAINED)),
        overrides=_as_tuple(pick("set", ())),
        class_names=tuple(class_names_files(pick("class_names")).items()),
    )
    if not grid.backbones:
        grid = dataclasses.replace(grid, backbones=default_backbones(grid.pretrained))
    opts = _exec_options(cfg, {**{k: given[k] for k in EXEC_KEYS},
                               "rates": str(given["rates"]) if given["rates"] is not None else None})
    settings = {field: pick(key) for field, key in {**sweep_run_fields(), **sweep_exec_fields()}.items()}
    out_dir = Path(settings["out"] if settings["out"] is not None else DEFAULT_OUT)
    runs = expand_grid(grid, left_out=left_out, **settings)
    return runs, opts, out_dir


@app.command()
def status(
    out: Path = typer.Option(DEFAULT_OUT, help="the sweep's shard root"),
    state: Optional[str] = typer.Option(None, help="show only runs in this state: " + ", ".join(STATES)),
) -> None:
    """Show the manifest as a table; states are refreshed from the jobs and the shards on disk."""
    console = _console()
    notes: list[str] = []
    try:
        if state is not None and state not in STATES:
            raise SweepError(f"unknown state {state!r}; available: {', '.join(STATES)}")
        with locked_manifest(Path(out).resolve(), must_exist=True) as m:
            refresh(m, notes=notes)
    except USER_ERRORS as e:
        fail(PROG, e, full=True)
    render_manifest(m, console, only=state)
    _say_notes(notes, set(), console)


@app.command()
def retry(
    out: Path = typer.Option(DEFAULT_OUT, help="the sweep's shard root"),
    executor: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    partition: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    account: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    qos: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    constraint: Optional[str] = typer.Option(None, help=_EXEC_HELP),
    gpus_per_job: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    cpus_per_job: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    mem_gb: Optional[float] = typer.Option(None, help=_EXEC_HELP),
    timeout_min: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    array_parallelism: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    local_jobs: Optional[int] = typer.Option(None, help=_EXEC_HELP),
    wait: Optional[bool] = typer.Option(None, "--wait/--no-wait", help="wait for the jobs [default: local only]"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be resubmitted"),
) -> None:
    """Resubmit only the failed runs (they resume from their valid shards), with the sweep's executor settings
    updated by the options given here."""
    console = _console()
    overrides = {k: v for k, v in {
        "executor": executor, "partition": partition, "account": account, "qos": qos, "constraint": constraint,
        "gpus_per_job": gpus_per_job, "cpus_per_job": cpus_per_job, "mem_gb": mem_gb, "timeout_min": timeout_min,
        "array_parallelism": array_parallelism, "local_jobs": local_jobs}.items() if v is not None}
    try:
        code = sweep_retry(Path(out), overrides, dry_run=dry_run, wait=wait, console=console)
    except USER_ERRORS as e:
        fail(PROG, e, full=True)
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; `run` is the default command. A usage error (`--limit abc`, an unknown option)
    is one line on stderr, exit 2, as every user error of the command."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h"):
        args.insert(0, "run")
    run_app(app, args or ["--help"], PROG)


if __name__ == "__main__":
    main()
