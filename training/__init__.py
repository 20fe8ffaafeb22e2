"""Replay-train: captured trajectories → a LoRA adapter, evaluated and gated before it is published.

- ``data``: training rows from the store (the exact token ids served, the loss on completions only), the mix
  with recovered and general rows, the general data and perplexity.
- ``sft``: LoRA supervised fine-tuning: evenly spaced checkpoints, metrics and a loss plot.
- The other modules: task suites, evaluation, the promotion gate and the command that runs it all.
"""
