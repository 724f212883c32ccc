"""The decode step captured as CUDA graphs: its inputs' layout, its per-layer compiled blocks, the
graphs per batch size."""
