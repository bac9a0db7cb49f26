"""The harness that checks and measures the trainer from outside, kept apart from the code that trains (modeling/,
lifecycle/ and trainer/ never import this).

`packing_check`: packed vs per-sample forward+backward on the same samples (scripts/verify_packing.py, the tests).
`routing_pin`: MoE top-k choices recorded per sample and replayed in the packed run, for that comparison.
`launch`: train.py runs in their own processes with their logs, killed with their process trees on timeout (the
comparison and parity scripts, the multi-process tests).
`provenance`: what every result file records (commit or source digest, date, GPU, library versions).
`varlen_reference`: the GPU's varlen attention call computed per segment on any device, for the CPU tests.
`curve_spread`: the exact test of a layout's loss curves against the default path's run-to-run spread
(scripts/curve_spread.py).
`bench_data`: the datasets the measurements write (LLaVA records at scale, long samples).
`plan_totals`: one epoch's planned packs, tokens and per-row counts, summed from the arrow columns.
`data_scale`: a command's wall time and sampled peak memory, and the repeated-records data with its cache prebuilt
(scripts/measure_data_scale.py).
`device_time`: a profiled step's device time by kernel category, busy time and idle gaps (scripts/profile_step.py).
`rope_bench`, `cp_attention_bench`, `lora_bench`, `parity`: the benchmarks and the multi-GPU comparison whose command
lines are scripts/bench_mrope.py, bench_cp_attention.py, bench_lora.py and distributed_parity.py.
"""
