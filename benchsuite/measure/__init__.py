"""Every metric of a request and a cell, defined once; the paging counters of a cell."""
