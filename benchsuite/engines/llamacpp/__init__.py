"""llama.cpp's wing: the adapter, the llama-server build from the pinned sdist, the memory
projection (`fit`), log facts, and the GGUF writers (`gguf_export`, `gguf_synth`)."""
