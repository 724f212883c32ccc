"""The OpenAI-compatible HTTP server (`python -m paged_experts.server`) and its continuous-batching
scheduler: flags and start-up (`launch`), the app (`app`), request validation (`protocol`), text
(`text`, `generation`), response shapes (`openai`), endpoints (`handlers`), metrics (`metrics`), the
engine loop (`engine`, `engine_types`) and sampling (`sampling`)."""
