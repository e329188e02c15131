"""KV transfer between instances: a gRPC control plane and a UCX data plane.

Hosted inside the prefill process (the server side: leases, control service, chunk server) and
the decode process (the puller). It is the one component two services embed; they still meet
only through the contracts in kvtransfer.proto and the KvHandle.
"""
