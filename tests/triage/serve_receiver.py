"""A ``Receiver`` in its own process with short deadlines, for the HTTP fuzz tests (its RSS is measured apart).

    python -m tests.triage.serve_receiver DB REQUEST_TIMEOUT_S IDLE_TIMEOUT_S MAX_BODY_BYTES

Binds port 0 on 127.0.0.1 and prints the port on stdout; SIGTERM stops it the way ``diag triage serve`` stops.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from diag.triage.server import Receiver, ReceiverConfig


def main(argv: list[str]) -> None:
    db, request_timeout_s, idle_timeout_s, max_body_bytes = argv
    rx = Receiver(
        ReceiverConfig(
            host="127.0.0.1", port=0, db=Path(db), request_timeout_s=float(request_timeout_s),
            idle_timeout_s=float(idle_timeout_s), max_body_bytes=int(max_body_bytes),
        )
    )  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, frame: rx.shutdown())
    print(rx.port, flush=True)
    try:
        rx.serve_forever()
    finally:
        rx.close()


if __name__ == "__main__":
    main(sys.argv[1:])
