"""Which experts sit on the device: eviction policies and slot maps (host and device planned), the
host expert store, pinned memory, paging counters."""
