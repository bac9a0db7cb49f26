"""The run's lifecycle: what keeps a run directory safe across crashes, restarts and shared machines, apart from
what trains.

`run_files` names and atomically writes the directory's files (metrics.jsonl, summary.json, config.yaml, run.lock);
`run_lock` lets one trainer hold a run directory; `checkpoint` saves, finds and loads checkpoints and writes the
export; `checkpoint_manifest` records in a checkpoint's COMPLETE marker what it holds and checks it, and
`trusted_resume` picks the checkpoint a resume may trust; `resume` checks what a resumed run's config may change;
`preemption` turns SIGTERM/SIGINT into a checkpoint and a clean exit the ranks agree on; `stack_dump` prints every
thread's stack on `kill -USR1`.
"""
