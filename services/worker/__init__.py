"""The layer the prefill and decode worker processes share: the engine loop's process side
(engine_loop), the tensor-parallel group with its follower processes, which mirror rank 0's
engine commands (tp_group), a follower's per-rank KV data plane (rank_kv), and the announcer
that keeps a worker's entry in the mesh's etcd, with the load feed every gateway subscribes to
(announcer).

It glues the engine (services.engine, the model runtime) to the KV transfer library
(services.kvtransfer); neither of those imports it or each other. RankKv implements the
engine's KvHooks protocol (services.engine.kv_hooks).
"""
