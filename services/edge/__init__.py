"""The edge: Envoy in front of the gateways (config generation and the Envoy process)."""
