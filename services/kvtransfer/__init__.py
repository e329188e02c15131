"""KV transfer between instances: a library, with a gRPC control plane and a UCX data plane.

The prefill and decode worker services embed it: the prefill process hosts the server side
(leases, control service, chunk server), the decode process the puller, and a tensor-parallel
follower of either its own share through the worker layer (services.worker.rank_kv). It imports
no engine, worker or service code (tests/test_layers.py): it moves bytes between KV cache
regions it is given. Instances still meet only through the contracts in kvtransfer.proto and
the KvHandle.
"""
