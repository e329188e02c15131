"""A UCX listener that listens on one address, not on all of them.

ucxx (0.52) listens on the wildcard address only: its C++ `ListenerBuilder::host` is not offered
to Python, so a worker started with `--host 127.0.0.1` accepted KV connections on every interface
of its machine. Here ucxx's listener is made as usual (its endpoints need a `ucxx::Listener` as
their parent), then its UCP listener is replaced by one made through UCP's C API on `host`:
`rebind` creates the bound UCP listener, writes its handle into the `ucxx::Listener` (which
destroys it when it is freed, as it would have its own) and destroys the wildcard one. Its
connection requests come to `_on_conn_request`, which makes each endpoint through ucxx as
ucxx's own callback would. The `ucxx::Listener` layout is checked against what ucxx reports (its
port and address) before anything is written; a layout that does not match is refused with
`UcxBindError`, never guessed.

The other UCX sockets of a process, the TCP transport's own listeners (one per network device),
are kept to the device holding `host` by UCX_NET_DEVICES (services/kvtransfer/ucx_setup.py).
"""

from __future__ import annotations

import ctypes
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("distserve.kvtransfer")

# ucxx::Listener (libstdc++, x86-64 and aarch64): a vtable pointer, Component's
# enable_shared_from_this (a weak_ptr) and _parent (a shared_ptr), then ucp_listener_h _handle,
# std::string _ip (pointer, length, 16-byte buffer), uint16_t _port.
_HANDLE_AT = 40
_IP_AT = 48
_PORT_AT = 80
_FIELD_SOCK_ADDR = 1 << 0
_FIELD_CONN_HANDLER = 1 << 2
_ATTR_FIELD_SOCKADDR = 1 << 0
_UCS_OK = 0

_ConnCallback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)


class UcxBindError(RuntimeError):
    """UCX's listener cannot be bound to the address asked for."""


class _Handler(ctypes.Structure):
    _fields_ = [("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p)]


class _ListenerParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("addr", ctypes.c_void_p),
        ("addrlen", ctypes.c_uint32),
        ("accept_handler", _Handler),
        ("conn_handler", _Handler),
    ]


class _ListenerAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("sockaddr", ctypes.c_ubyte * 128)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_uint16),
        ("port", ctypes.c_uint16),  # network order
        ("addr", ctypes.c_ubyte * 4),
        ("zero", ctypes.c_ubyte * 8),
    ]


def is_wildcard(host: str) -> bool:
    """Whether `host` means every address (nothing to bind to)."""
    return host in ("", "0.0.0.0", "::")


def _ucp() -> ctypes.CDLL:
    """The libucp ucxx runs on (the one already in this process, found by its mapped path)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libucp.so" in line}
    if not paths:
        raise UcxBindError("libucp is not loaded in this process (start a UCX worker first)")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.ucp_listener_create.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_listener_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_listener_destroy.argtypes = [ctypes.c_void_p]
    lib.ucp_listener_reject.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _sockaddr(host: str, port: int) -> ctypes.Structure:
    """`host` (an IPv4 address, or a name resolved once) and `port`."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UcxBindError(f"cannot resolve the listen address {host!r}: {e}") from e
    if family != socket.AF_INET:  # UCX's TCP transport here reaches IPv4 peers only
        raise UcxBindError(
            f"the KV data plane (UCX) listens on IPv4 addresses only, not {host!r}: give the "
            "worker an IPv4 --host, or --no-ucx to move KV over gRPC"
        )
    sa = _SockaddrIn(family=family, port=socket.htons(port))
    sa.addr[:] = socket.inet_pton(family, addr[0])
    return sa


def _queried_port(ucp: ctypes.CDLL, handle: int) -> int:
    attr = _ListenerAttr(field_mask=_ATTR_FIELD_SOCKADDR)
    if ucp.ucp_listener_query(handle, ctypes.byref(attr)) != _UCS_OK:
        raise UcxBindError("ucp_listener_query failed")
    return int.from_bytes(bytes(attr.sockaddr[2:4]), "big")  # same offset in sockaddr_in{,6}


def _check_layout(listener) -> None:
    """Refuse unless the words read at the fields' offsets are the ones ucxx reports."""
    base = listener.ucxx_ptr
    ip_ptr = ctypes.c_void_p.from_address(base + _IP_AT).value
    ip_len = ctypes.c_size_t.from_address(base + _IP_AT + 8).value
    port = ctypes.c_uint16.from_address(base + _PORT_AT).value
    expected = listener.ip.encode()
    if port != listener.port or ip_len != len(expected) or not ip_ptr:
        raise UcxBindError(
            "this ucxx's Listener is laid out otherwise than expected: UCX's listener cannot be "
            "bound to one address (start the worker with --host 0.0.0.0, or use the pinned ucxx)"
        )
    if ctypes.string_at(ip_ptr, ip_len) != expected:
        raise UcxBindError("this ucxx's Listener is laid out otherwise than expected")


# key -> (the bound UCP listener's handle, what accepts its connections; None once closed)
_accepting: dict[int, tuple[int, Callable[[int], None] | None]] = {}


@_ConnCallback
def _on_conn_request(conn_request: int, arg: int) -> None:
    """A connection request on a bound listener (called inside UCX's progress)."""
    handle, accept = _accepting.get(arg or 0, (0, None))
    try:
        if accept is None:
            if handle:
                _ucp().ucp_listener_reject(handle, conn_request)
            return
        accept(conn_request)
    except Exception:  # never into UCX's C frames
        log.exception("accepting a UCX connection failed")


class Binding:
    """A ucxx listener bound to one address: its port, and `close` to stop accepting (UCP
    destroys the listener itself once ucxx frees its `ucxx::Listener`)."""

    def __init__(self, key: int, port: int) -> None:
        self.key, self.port = key, port

    def close(self) -> None:
        handle, _ = _accepting[self.key]
        _accepting[self.key] = (handle, None)  # later requests are rejected


def rebind(
    listener, worker_handle: int, host: str, port: int, accept: Callable[[int], None]
) -> Binding:
    """Make ucxx's `listener` (of the UCP worker `worker_handle`) listen on `host`:`port` alone
    (0: any free port) instead of its wildcard address; each connection request goes to
    `accept(conn_request)`. Called on the thread that progresses the worker."""
    _check_layout(listener)
    ucp = _ucp()
    slot = ctypes.c_void_p.from_address(listener.ucxx_ptr + _HANDLE_AT)
    old = slot.value
    if not old or _queried_port(ucp, old) != listener.port:
        raise UcxBindError("this ucxx's Listener is laid out otherwise than expected")
    sa = _sockaddr(host, port)
    key = max(_accepting, default=0) + 1
    _accepting[key] = (0, accept)
    new = ctypes.c_void_p()
    params = _ListenerParams(
        field_mask=_FIELD_SOCK_ADDR | _FIELD_CONN_HANDLER,
        addr=ctypes.addressof(sa),
        addrlen=ctypes.sizeof(sa),
        conn_handler=_Handler(ctypes.cast(_on_conn_request, ctypes.c_void_p), key),
    )
    status = ucp.ucp_listener_create(worker_handle, ctypes.byref(params), ctypes.byref(new))
    if status != _UCS_OK:
        del _accepting[key]
        raise UcxBindError(f"UCX cannot listen on {host}:{port} (UCS status {status})")
    port = _queried_port(ucp, new.value)
    _accepting[key] = (new.value, accept)
    slot.value = new.value  # the ucxx::Listener owns the bound listener now...
    ctypes.c_uint16.from_address(listener.ucxx_ptr + _PORT_AT).value = port
    ucp.ucp_listener_destroy(old)  # ...and the wildcard one is gone
    return Binding(key, port)
