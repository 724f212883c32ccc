"""Instruments and formulas that stand alone: machine facts, the NVML sampler, the link probe,
preflight arithmetic, the paging simulator, Prometheus scraping, published reference figures."""
