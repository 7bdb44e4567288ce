"""Candidate: hand the request body to the forwarder in batches, not one QUIC frame at a time.

`TunnelStream.receive()` returns one queued chunk (about one QUIC packet,
~1.2 KB), and each becomes its own upstream write (httpcore + anyio + a
timeout per chunk): ~850 writes per MiB. This launcher makes `receive()`
return every chunk already queued, up to BATCH_BYTES, in one piece. It copies
the method's current logic (tunnel/stream.py), so it is tied to that version.

Run: python -m bench compare --workload upload \
        --candidate-command "python -m bench.experiments.coalesce_body"
"""

from __future__ import annotations

import sys

from tunnel.stream import TunnelStream

BATCH_BYTES = 64 * 1024


async def receive_batched(self: TunnelStream) -> bytes:
    """Next part of the request body (all queued chunks, up to BATCH_BYTES); b"" at the end."""
    while not self._chunks:
        if self._aborted is not None:
            raise self._aborted
        if self._received_all:
            return b""
        self._data_ready.clear()
        await self._data_ready.wait()
    parts, size = [], 0
    while self._chunks and size < BATCH_BYTES:
        chunk = self._chunks.popleft()
        parts.append(chunk)
        size += len(chunk)
    self._owner.stream_consumed(self.stream_id, size)
    return b"".join(parts)


def main() -> int:
    setattr(TunnelStream, "receive", receive_batched)  # noqa: B010 (patch for the experiment)
    from pylon.cli import main as pylon_main

    return pylon_main()


if __name__ == "__main__":
    sys.exit(main())
