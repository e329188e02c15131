"""The decode service: pulls prompts' KV and generates with continuous batching. The same
process, with role colocated, prefills locally (the baseline and the short-prompt path)."""
