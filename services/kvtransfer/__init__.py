"""KV transfer between instances: a library, with a gRPC control plane and a UCX data plane.

The prefill and decode worker services embed it: the prefill process hosts the server side
(leases, control service, chunk server), the decode process the puller, and a tensor-parallel
follower of either its own share through the worker layer (services.worker.rank_kv). It imports
no engine, worker or service code (tests/test_layers.py): it moves bytes between KV cache
regions it is given. Instances still meet only through the contracts in kvtransfer.proto and
the KvHandle.

- Server side: `leases` (who may fetch held KV, until when), `source` (the chunks a request
  asks for, checked and checksummed; `crc_combine`), `chunk_server` (UCX) and `servicer` (gRPC
  control and the FetchChunk fallback), `faults` (injected faults, tests and drills only).
- Client side: `puller` (a pull, its retries and checks), `transports` (UCX and gRPC fetches),
  `layout` (where the chunks land). It imports nothing of the server side
  (tests/kvtransfer/test_sides.py).
- Both: `wire` (frames), `checksums` (CRC-32C of a chunk), `refusals` (a refusal's reason both
  ways), `ucx_loop` (UCX on the event loop), `ucx_setup` (UCX settings of a process).
"""
