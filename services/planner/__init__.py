"""The planner: profiles a model, simulates clusters, searches placements for goodput, and
sizes the running mesh.

Two deciders live here; one moves the mesh. The `Autoscaler` (autoscale.py), run by the
`ControlLoop` (control.py) when the planner starts with `--budget`, is the only one whose
decisions reach an actuator's `Apply` (actuator.py, its steps in transition.py). The drift
`Replanner` (replanner.py) searches a whole placement (parallelism per phase, replicas, node
mapping) when the workload drifts and reports it (Plan, GetPlacement, ReportWorkload's reply),
applying nothing: its docstring says why it stays.

Pure domain logic (latency model, workload, simulator, goodput search, placement, drift, the
autoscaler and the surge test) is importable without torch or gRPC; the profiler loads the
engine, and the servicer and actuator the stubs, only when used.
"""
