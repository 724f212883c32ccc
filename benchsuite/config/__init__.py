"""The matrix: YAML read safely, validated, expanded into servers and cells (the plan)."""
