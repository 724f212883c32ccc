"""Engine adapters by kind (a plain dict registry; see base.EngineAdapter)."""
