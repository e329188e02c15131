"""Options passed through to the mesh's processes, per role, for `distserve up` and `distserve
deploy render` alike.

Every option a worker or the gateway takes is reachable one way: `--worker-args` (every worker),
`--prefill-args`, `--decode-args`, `--colocated-args` and `--gateway-args`, each a string of that
process's own options as its command line takes them, e.g. `--decode-args "--kv-cache-gib 8
--max-num-seqs 128"` or `--gateway-args "--local-prefill-max-tokens 64"` (a lone flag takes the
`=` form, `--colocated-args=--no-prefix-cache`: argparse reads a value that starts with `--` and
holds no space as an option of its own). A role's string comes
after `--worker-args`, so it wins where both give an option. Each is checked before anything
starts, by the process's own parser (an unknown option or a bad value is refused by name), and an
option the launcher sets itself (the model, addresses, worker ids, the tensor degree) is refused
with what to use instead: passing it through would make the launcher and the process disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields

from services.common.errors import DistServeError, InvalidRequest

WORKER_ROLES = ("prefill", "decode", "colocated")
_SET = "launcher-sets-this"  # a value nobody passes: an option that changes it was given

# Options the launcher sets itself: (attribute of the parsed options, a value that parses,
# why the launcher's must stand).
_WORKER_OWN = (
    ("model", f"/{_SET}", "give the launcher's --model"),
    ("etcd", f"http://{_SET}:1", "every worker joins the launcher's etcd (`up --etcd`)"),
    ("host", _SET, "the launcher's --host, or a pod's IP"),
    ("worker_id", _SET, "the launcher names every worker"),
    ("tensor_parallel_size", "977", "`up --prefill-tp/--decode-tp/--colocated-tp`, or the plan's"),
)
_GATEWAY_OWN = (
    ("model", f"/{_SET}", "give the launcher's --model"),
    ("host", _SET, "the launcher's --host, or the pod's"),
    ("port", "1", "`up --port`; a pod's ports are fixed"),
    ("http_port", "1", "`up --gateway-http-port`; a pod's ports are fixed"),
    ("planner", f"{_SET}:1", "`up --planner`, or the rendered planner"),
    ("etcd", f"http://{_SET}:1", "the launcher's etcd (`up --etcd`)"),
)
_PORTS = (
    ("port", "1", "a pod's ports are fixed"),
    ("metrics_port", "1", "a pod's ports are fixed"),
    ("health_port", "1", "a pod's ports are fixed; under mesh TLS the renderer sets it"),
)


@dataclass(frozen=True)
class RoleArgs:
    """Each process's pass-through options, already split into arguments."""

    worker: tuple[str, ...] = ()  # every worker, before its role's own
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    gateway: tuple[str, ...] = ()

    def for_worker(self, role: str) -> tuple[str, ...]:
        """A `role` worker's options: every worker's, then its role's."""
        return (*self.worker, *getattr(self, role))


def add_role_args(p: argparse.ArgumentParser) -> None:
    """The pass-through options (module docstring)."""
    g = p.add_argument_group(
        "options of the mesh's processes",
        "each a quoted string of the process's own options, e.g. --decode-args "
        '"--kv-cache-gib 8 --max-num-seqs 128" (`python -m services.prefill --help`, '
        "`services.decode`, `services.gateway` list them); one flag alone takes the = form: "
        "--colocated-args=--no-prefix-cache",
    )
    g.add_argument("--worker-args", default="", help="for every worker (engine options...)")
    for role in WORKER_ROLES:
        g.add_argument(f"--{role}-args", default="", help=f"for {role} workers (after those)")
    g.add_argument(
        "--gateway-args", default="", help="for the gateway, e.g. --local-prefill-max-tokens 64"
    )


def role_args(
    args: argparse.Namespace, engine_args: tuple[str, ...] = (), fixed_ports: bool = False
) -> RoleArgs:
    """The pass-through options of `add_role_args`, checked (InvalidRequest naming the flag)
    as the workers will take them after the launcher's `engine_args` (e.g. an emulated
    engine's). fixed_ports: the launcher also sets every process's ports (a pod's)."""
    split = {}
    for f in fields(RoleArgs):
        flag = f"--{f.name}-args"
        try:
            split[f.name] = tuple(shlex.split(getattr(args, f"{f.name}_args")))
        except ValueError as e:
            raise InvalidRequest(f"{flag}: {e}") from e
    out = RoleArgs(**split)
    ports = _PORTS if fixed_ports else ()
    for role in WORKER_ROLES:
        given = out.for_worker(role)
        parse = _worker_parser(role, engine_args)
        _check(f"--{role}-args", given, parse, (*_WORKER_OWN, *ports))
    gateway_own = (*_GATEWAY_OWN, *ports[1:])  # its --port is the launcher's anyway
    _check("--gateway-args", out.gateway, _gateway_parser, gateway_own)
    return out


def _worker_parser(role: str, engine_args: tuple[str, ...]) -> Callable[[list[str]], object]:
    """Parses a `role` worker's command line as the launcher gives it; InvalidRequest if the
    options change its role or engine (choices: no value nobody passes)."""
    if role == "prefill":
        from services.prefill.__main__ import parse as parse_prefill

        def parse(argv: list[str]) -> argparse.Namespace:
            return parse_prefill([*engine_args, *argv])[1]
    else:
        from services.decode.__main__ import parse as parse_decode

        def parse(argv: list[str]) -> argparse.Namespace:
            return parse_decode([*engine_args, "--role", role, *argv])[1]

    engine = "emulated" if engine_args else "torch"

    def checked(argv: list[str]) -> argparse.Namespace:
        ns = parse(argv)
        if getattr(ns, "role", role) != role:
            raise InvalidRequest(f"--role is set by the launcher: use --{ns.role}-args")
        if ns.engine != engine:
            raise InvalidRequest("--engine is set by the launcher: use its --engine")
        return ns

    return checked


def _gateway_parser(argv: list[str]) -> object:
    from services.gateway.__main__ import parse

    return parse(argv)


def _check(
    flag: str,
    given: tuple[str, ...],
    parse: Callable[[list[str]], object],
    own: tuple[tuple[str, str, str], ...],
) -> None:
    """Parse `given` after the launcher's own options set to values nobody passes: an error of
    the parser, or a launcher's option that changed, is refused naming `flag`."""
    if not given:
        return
    base = [a for name, value, _ in own for a in (f"--{name.replace('_', '-')}", value)]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = parse([*base, *given])
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        reason = lines[-1].split("error: ", 1)[-1] if lines else "not valid"
        raise InvalidRequest(f"{flag} {shlex.join(given)!r}: {reason}") from None
    except DistServeError as e:
        raise InvalidRequest(f"{flag} {shlex.join(given)!r}: {e}") from e
    for name, value, why in own:
        if str(getattr(parsed, name)) != value:
            option = f"--{name.replace('_', '-')}"
            raise InvalidRequest(f"{flag}: {option} is set by the launcher ({why})")


def worker_options(role: str, given: tuple[str, ...]) -> argparse.Namespace:
    """A `role` worker's options as its own parser reads `given` (the rest at its defaults):
    what `deploy render` sizes a pod's memory from (its KV pool, batch sizes, dtype)."""
    return _worker_parser(role, ())(["--model", f"/{_SET}", *given])
