"""The prefill service: runs prompts in batches and holds their KV for decode instances."""
