"""The built-in engine's wing: its adapter (`adapter.BuiltinAdapter`, the `kind: builtin` options)."""
