"""Online serving: an engine with continuous batching (``engine``), its scheduler (``scheduler``:
NEO's load-aware choice and APEX's Inequality 6), a block manager per KV pool (``kv_blocks``),
sampling per request (``sampling``) and the OpenAI-compatible HTTP front (``server``, the
``[serve]`` extra). ``types`` holds what these rooms pass each other."""
