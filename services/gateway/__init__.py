"""The gateway: the public API, validation, routing, streaming, and the worker registry.
It never runs the model and never imports torch."""
