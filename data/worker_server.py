"""Imported by the forkserver that starts the data loader's workers (`data.pipeline.worker_start_context`), before
it forks any. The server and every worker it forks then answer SIGUSR1 with their threads' Python stacks, as
train.py does, from their first instruction: a handler a worker set itself would leave a window in which the signal
(scripts/launch.py sends it to every process of a run) kills it. It also imports the pipeline, so each worker starts
with torch, transformers and datasets loaded and only unpickles its epoch."""

import faulthandler
import signal

import data.pipeline  # noqa: F401  (loaded once in the server, for every worker)

faulthandler.register(signal.SIGUSR1, all_threads=True)
