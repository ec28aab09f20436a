"""A run of the extractor as named steps over small objects (docs/architecture.md, "The objects of a run").

    options.py   RunOptions (what decides the result), ExecOptions (how it executes), plan() -> PlannedRun,
                 and the one place where defaults live (backbone, seed, folders and their environment fallbacks)
    settings.py  RunData (the listed test set and its identity), run_settings, the finished-run check
    ood.py       an out-of-distribution run's data: the mixed list of both sets, its identity, its shard keys
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
