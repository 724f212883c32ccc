import sys

try:
    from benchsuite.cli import entry
except KeyboardInterrupt:  # Ctrl-C while the interpreter imports the CLI: one line, as cli.main prints
    print("benchsuite: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(entry())
