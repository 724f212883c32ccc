"""SGLang's wing: the adapter, the paged-experts constraint checks, log facts and routing capture."""
