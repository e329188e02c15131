"""The planner: profiles a model, simulates clusters, searches placements for goodput, replans.

Pure domain logic (latency model, workload, simulator, goodput search, placement, drift) is
importable without torch or gRPC; the profiler loads the engine and the servicer the stubs only
when used.
"""
