"""`python -m paged_experts.server`: the built-in OpenAI-compatible server."""

import sys

try:
    from paged_experts.server.app import main
except KeyboardInterrupt:  # Ctrl-C while torch and the server import (the first seconds): one line
    print("paged_experts.server: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
