"""``lit-titan store [--host HOST] [--port PORT]``: host the job's store for one launch per replica group.

Under replica-group fault tolerance every group's ranks meet in one TCPStore (heartbeats, membership,
the rejoin's admission). With one torchrun agent per replica group, no agent's store serves: each
agent's rendezvous store is its own group's, and it ends when that agent ends (its group finished
first, or ran out of restarts) while the others still need it. This process hosts the store and
nothing else (it never dies with a group), until SIGTERM or SIGINT; give its address to every group
as ``fault_tolerance.store=HOST:PORT`` (docs/fault_tolerance.md, "Launching one torchrun per replica group").
Start one per job: a store keeps the last job's keys.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from datetime import timedelta

__all__ = ["DEFAULT_PORT", "main"]

DEFAULT_PORT = 29600  # what `lit-titan launch` prints for the store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lit-titan store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=socket.getfqdn(), help="the name the groups reach it by (printed)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0: a free one, printed)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= args.port < 65536:
        print(f"lit-titan: error: --port={args.port}: not a port; use 1..65535 (0: a free one)", file=sys.stderr)
        sys.exit(2)
    import torch.distributed as dist

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        store = dist.TCPStore(
            "0.0.0.0", args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
    except (RuntimeError, OSError) as err:  # the port is taken, or not ours to bind
        print(f"lit-titan: error: --port={args.port}: cannot listen ({err}); choose another port", file=sys.stderr)
        sys.exit(2)
    print(
        f"lit-titan: store listening on {args.host}:{store.port}; give every replica group "
        f"fault_tolerance.store={args.host}:{store.port} (stop with SIGTERM once the job ended)",
        flush=True,
    )
    stop.wait()
    del store


if __name__ == "__main__":
    main()
