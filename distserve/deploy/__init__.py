"""Kubernetes manifests rendered from a planner placement (`distserve deploy render`)."""
