"""One module per CLI subcommand; each exposes `configure(parser)` and `main(args) -> int`."""
