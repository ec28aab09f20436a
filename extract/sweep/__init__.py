"""`zaec-sweep`: the grid methods x datasets x backbones x seeds as jobs (SLURM or one machine) via submitit.

    cli       the command line (typer): run, status, retry; option parsing, the config file, rendering
    grid      the grid as given, its expansion into resolved runs, grouping by feature cache, packing, the plan
              table
    cost      the cost model of `--dry-run` (measured `--rates`, else each method's work on a card), priced per run
    runspec   where the sweep meets the extractor: RunSpec (RunOptions + ExecOptions), the sweep options derived
              from their fields, the call into `execute`, the extractor's finished-run check
    manifest  the sweep's files: the manifest and its lock, the per-run result files, atomic JSON I/O
    state     the pure job-state transition of a manifest row (pending, running, done, failed, lost)
    track     the facts of a row (result pickle, squeue then sacct, job log, process) and `refresh`, which applies
              `state`
    submit    executor settings, SLURM parameters, local GPU assignment, submission through submitit
    job       what a job runs on its worker (imports submitit)
    errors    SweepError
"""

from extract.sweep.cli import app, main

__all__ = ["app", "main"]
