"""The load generator: prompts, the streaming client, SSE parsing, closed-loop and Poisson load."""
