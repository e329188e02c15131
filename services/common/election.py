"""Leader election on etcd: of several replicas campaigning under one name, one leads at a time;
when it dies the next takes over within its lease's TTL.

This is etcd's own election recipe (`clientv3/concurrency`'s `Election.Campaign`, the one etcd's
server-side `v3electionpb` service runs), done over the v3 KV, Lease and Watch stubs that the
`aetcd` package ships (it ships no `v3electionpb` stubs, and services/common/discovery.py already
speaks these): each candidate grants a lease, creates `<prefix>election/<name>/<lease id>` in a
transaction only if absent (attached to the lease), and leads once no key under the name has a
lower create revision; until then it watches the key just before its own for deletion. etcd's
linearizable revisions decide the order; nothing here votes. A candidate keeps its lease alive
every TTL/3; a dead one's lease lapses and etcd deletes its key, which wakes the next in line.

A leader steps down on its own when it could not renew its lease before the lease's expiry as
seen from here (the renewal's send time + the TTL etcd granted): etcd's expiry is no earlier, so
a leader cut off from etcd stops leading before a standby can start. A paused process can
still act once after losing (nothing fences what it asks of others): keep actions idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc

from services.common.etcd_client import REQUIRE_LEADER, EtcdClient, EtcdConfig

log = logging.getLogger("distserve.election")

DEFAULT_TTL_S = 5.0  # a dead leader is replaced within this; etcd's minimum is 2 s (whole s)


class Election:
    """Campaign for `name` on the etcd `etcd` as `value` (what the others see of the leader,
    e.g. its address). `run()` campaigns until cancelled; `leading` says whether this replica
    leads now, `leader` the value of the one that does ("" while unknown)."""

    def __init__(
        self,
        etcd: EtcdConfig,
        name: str,
        value: str,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str | None = None,
        retry_s: float = 0.5,
    ) -> None:
        """`prefix`: default the configuration's (`--etcd-prefix`)."""
        prefix = prefix or etcd.prefix
        if ttl_s < 2:
            raise ValueError(f"an election's lease TTL is at least 2 s (etcd's minimum): {ttl_s}")
        self.etcd = EtcdClient(etcd)
        self._rpc = self.etcd.rpc
        self.name, self.value = name, value
        self.ttl_s = math.ceil(ttl_s)  # etcd counts TTLs in whole seconds
        self.retry_s = retry_s
        self._prefix = f"{prefix}election/{name}/".encode()
        self._lease_id = 0
        self._deadline = 0.0  # time.monotonic() when our lease may have lapsed on etcd
        self._leading = False
        self.leader = ""
        self._changed = asyncio.Condition()

    @property
    def leading(self) -> bool:
        return self._leading and time.monotonic() < self.lease_deadline

    @property
    def lease_deadline(self) -> float:
        """time.monotonic() past which this replica does not lead, renewed or not: its last
        renewal's send time + the TTL etcd granted (etcd's own expiry is no earlier)."""
        return self._deadline

    async def wait(self, leading: bool) -> None:
        """Return once this replica leads (`leading`) or stands by (not `leading`)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._leading == leading)

    async def run(self) -> None:
        """Campaign, lead while the lease holds, campaign again when it lapses; until cancelled
        (then resign: the next in line leads at once rather than after a TTL)."""
        try:
            while True:
                keep = None
                try:
                    await self._campaign()
                    keep = asyncio.create_task(self._keep_alive())
                    turn = asyncio.create_task(self._wait_turn())
                    await asyncio.wait({keep, turn}, return_when=asyncio.FIRST_COMPLETED)
                    if turn.done() and not keep.done():
                        turn.result()
                        self.leader = self.value
                        await self._set(True)
                        log.info("leading %s (lease %x)", self.name, self._lease_id)
                        await keep
                    turn.cancel()
                except grpc.aio.AioRpcError as e:
                    self.etcd.failed(e)
                    log.warning("election %s: %s", self.name, self.etcd.explain(e))
                finally:
                    if keep is not None:
                        keep.cancel()
                    if self._leading:
                        log.warning("lost the lease: no longer leading %s", self.name)
                    # our key, if etcd still holds it, must not queue ahead of the next campaign
                    await self.resign()
                await asyncio.sleep(self.retry_s)
        finally:
            await asyncio.shield(self.resign())

    async def _set(self, leading: bool) -> None:
        async with self._changed:
            self._leading = leading
            self._changed.notify_all()

    async def _campaign(self) -> None:
        """Join the queue: a new lease, and our key created under it (if absent)."""
        rpc, etcd = self._rpc, self.etcd
        request = rpc.LeaseGrantRequest(TTL=self.ttl_s)
        grant = await etcd.call(lambda: etcd.lease.LeaseGrant(request, timeout=5))
        self._lease_id = grant.ID
        self._deadline = time.monotonic() + grant.TTL
        key = self._prefix + f"{grant.ID:x}".encode()
        absent = rpc.Compare(
            result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key, create_revision=0
        )
        put = rpc.PutRequest(key=key, value=self.value.encode(), lease=grant.ID)
        txn = rpc.TxnRequest(
            compare=[absent],
            success=[rpc.RequestOp(request_put=put)],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
        )
        reply = await etcd.call(lambda: etcd.kv.Txn(txn, timeout=5))
        if reply.succeeded:
            self._revision = reply.header.revision
        else:
            self._revision = reply.responses[0].response_range.kvs[0].create_revision

    async def _wait_turn(self) -> None:
        """Return once no candidate joined before us: wait for each predecessor's key to go."""
        rpc, etcd = self._rpc, self.etcd
        end = self._prefix[:-1] + bytes([self._prefix[-1] + 1])
        while True:
            oldest = rpc.RangeRequest(
                key=self._prefix,
                range_end=end,
                limit=1,
                sort_order=rpc.RangeRequest.ASCEND,
                sort_target=rpc.RangeRequest.CREATE,
            )
            first = await etcd.call(lambda: etcd.kv.Range(oldest, timeout=5))  # noqa: B023
            if first.kvs:
                leader = first.kvs[0].value.decode(errors="replace")
                if leader != self.leader:
                    log.info("standing by for %s: %s leads", self.name, leader)
                self.leader = leader
            previous = rpc.RangeRequest(
                key=self._prefix,
                range_end=end,
                limit=1,
                max_create_revision=self._revision - 1,
                sort_order=rpc.RangeRequest.DESCEND,
                sort_target=rpc.RangeRequest.CREATE,
            )
            before = await etcd.call(lambda: etcd.kv.Range(previous, timeout=5))  # noqa: B023
            if not before.kvs:
                return
            # the leader seen may change without our predecessor going (3+ replicas): look again
            # at least once a TTL
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._deleted(before.kvs[0].key, before.header.revision + 1), self.ttl_s
                )

    async def _deleted(self, key: bytes, since: int) -> None:
        """Return when `key` is deleted at or after revision `since` (or the watch ends)."""
        rpc = self._rpc
        call = self.etcd.watch.Watch(metadata=REQUIRE_LEADER)
        try:
            create = rpc.WatchCreateRequest(
                key=key, start_revision=since, filters=[rpc.WatchCreateRequest.NOPUT]
            )
            await call.write(rpc.WatchRequest(create_request=create))
            async for reply in call:
                if reply.canceled or reply.compact_revision:
                    return  # look again
                if any(e.type == rpc.Event.DELETE for e in reply.events):
                    return
        finally:
            call.cancel()

    async def _keep_alive(self) -> None:
        """Renew the lease every TTL/3; return when it lapsed, or when it could not be renewed
        before it may have lapsed on etcd."""
        rpc = self._rpc
        while True:
            sent = time.monotonic()
            left = self._deadline - sent
            if left <= 0:
                log.warning("could not renew the lease of %s within its TTL", self.name)
                return
            try:
                call = self.etcd.lease.LeaseKeepAlive(
                    iter([rpc.LeaseKeepAliveRequest(ID=self._lease_id)]),
                    timeout=min(left, self.ttl_s / 3),  # then another member, while it holds
                )
                try:
                    reply = await call.read()
                finally:
                    call.cancel()
                if reply is grpc.aio.EOF or reply.TTL <= 0:
                    log.warning("the lease of %s lapsed", self.name)
                    return
                self._deadline = sent + reply.TTL
                pause = self.ttl_s / 3
            except grpc.aio.AioRpcError as e:
                log.info("renewing the lease of %s: %s", self.name, self.etcd.explain(e))
                # the next member soon, while the lease holds; the same one after a pause
                pause = 0.1 if self.etcd.failed(e) else self.retry_s
            await asyncio.sleep(max(0.0, min(pause, self._deadline - time.monotonic())))

    async def resign(self) -> None:
        """Give up the lead (or the place in the queue) now: revoke the lease, which deletes
        our key."""
        lease, self._lease_id = self._lease_id, 0
        await self._set(False)
        if not lease:
            return
        try:
            revoke = self._rpc.LeaseRevokeRequest(ID=lease)
            await self.etcd.call(lambda: self.etcd.lease.LeaseRevoke(revoke, timeout=5))
        except grpc.aio.AioRpcError as e:  # lapsed already, or etcd away: it lapses by itself
            log.info("revoking lease %x: %s", lease, e.code().name)

    async def close(self) -> None:
        await self.etcd.close()
