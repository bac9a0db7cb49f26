"""The bottom layer: facts and machinery every other package may use, and which imports none of them.

`core.config_tree`: typed YAML config trees (ConfigError, nearest-key errors, overrides, saving).
`core.config` (with `core.data_config`'s data and packing sections): the recipe schema, `load_config`.
`core.families`: the Qwen-VL families this repo trains, each fact about a family declared once.
"""
