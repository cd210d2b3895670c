"""Model adapters: the engine here (the adapter base and its collaborators: the call path, the conversation, the
hook owner; `hf` for transformers' internals; the probes; the LLM stages in `llm/`; sparse prefill) and one file
per model family in `families/`, found by `vtoken.registry` (importing this package registers nothing and imports
no family: the registry asks `families.family_adapters()`)."""
