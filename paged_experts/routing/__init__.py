"""Synthetic routing sources, their counter-based draws, and the routing trace format."""
