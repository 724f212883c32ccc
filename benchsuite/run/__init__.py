"""The run loop: engine processes, one server's life, one cell measured, searches against a budget."""
