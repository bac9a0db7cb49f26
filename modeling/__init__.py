"""The model room: what adapts a transformers Qwen-VL model for packed training, and nothing that runs a loop.

`build` makes the model from a checkpoint or a recipe-defined config; `packed` gives it the packed (THD) forward with
per-sample boundaries on the varlen engine `attention_engines` picks, `gated_delta` (checked by `gated_delta_check`)
does the same for Qwen3.5's Gated DeltaNet, `context_parallel` shards a pack over ranks, `vision_plan` and
`patch_embed` serve the vision tower, `compile` and `eager_reductions` compile its blocks regionally, `lora` and
`master_weights` choose which weights train and in which precision, `fp8` puts the decoder's linears on float8,
`parts` names the vision / merger / LLM parts, and `loss_kernel` is the Triton kernel of the fused loss.
These modules read the config schema (core/) and the data layout (data/); the trainer and the run's lifecycle sit on
top of them.
"""
