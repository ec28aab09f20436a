"""A run of the extractor as named steps over small objects (docs/architecture.md, "The objects of a run").

    options.py   RunOptions (what decides the result), ExecOptions (how it executes), plan() -> PlannedRun,
                 and the run's defaults (seed, sizes, output folder; those the low floors need too, the backbone
                 and the folders with their environment fallbacks, are in `extract.defaults`)
    rundata.py   RunData (the listed test set and its identity), the resolved data root of a set
    ood.py       an out-of-distribution run's data: the mixed list of both sets, its identity, its shard keys
    settings.py  load_run_data (a plain run's data, or ood's), run_settings, the finished-run check
    rundir.py    RunDir: where a run's parts and marker live
    lock.py      RunLock: one process per run folder (flock + an owner file with a heartbeat)
    resume.py    scan_resume (read-only) -> ResumePoint, then apply_resume (the rewrites it calls for)
    encode.py    the encoding pass into the feature cache, and the reader of cached features
    stream.py    the stream order, the runtime state of the adapt loop, replay and the adapt loop
    writer.py    PartWriter (one shard per part) and the completion marker
    setup.py     prompts, text prototypes, the method object and the shard metadata of a run
    progress.py  the progress display and warnings

The package imports nothing heavy here: `extract.run.options` is read by the command lines before torch loads.
`extract.runner.run_extraction` composes the steps.
"""
