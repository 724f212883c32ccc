"""`python -m paged_experts.server`: the built-in OpenAI-compatible server."""

import sys

from paged_experts.server.app import main

sys.exit(main())
