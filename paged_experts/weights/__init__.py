"""Where weights come from: safetensors loading, the block-FP8 format, generated checkpoints and
their one seeded definition, the source-weights fingerprint."""
