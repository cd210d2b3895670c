"""One adapter per model family: what differs between VLMs (their towers, token layouts, prompts and signals),
built on the engine one level up (`adapters/base.py`, `calls.py`, `hf.py`, `probes.py`, `llm/`)."""
