"""Training: the typed config, model build, packed forward, loop, metrics and checkpoints behind train.py."""
