"""DistServe mesh: prefill/decode-disaggregated LLM serving as independent gRPC services."""
