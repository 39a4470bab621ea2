"""`expertcache quantize`: the offline tool that rewrites a checkpoint with quantized routed experts.

It sits above models/ and experts/ (it reads a checkpoint through them); the formats themselves
live in quant/, below the kernels. `rewrite.quantize_checkpoint` does the work, `cli` registers
the subcommand (light: the CLI imports it to build its parser).
"""
