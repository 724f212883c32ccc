"""The results store: a run directory's files, its manifest, lock and fingerprints, read back checked."""
