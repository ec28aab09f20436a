"""`zaec-sweep`: the grid methods x datasets x backbones x seeds as jobs (SLURM or one machine) via submitit.

    cli   the command line (typer): plan, submit, status, retry; rendering of the plan and the manifest
    plan  pure and file-level: grid expansion, grouping by feature cache, cost estimate, the manifest
    job   what a job runs on its worker (imports submitit)
"""

from extract.sweep.cli import app, main

__all__ = ["app", "main"]
