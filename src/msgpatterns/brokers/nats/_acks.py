"""Which JetStream acks the server has surely received (sans-I/O).

An ack is a plain publish to the delivery's reply subject: the client writes it and
moves on. When the connection dies, acks written just before are lost with it, and the
client does not send them again after it reconnects: their deliveries stay pending
until ``ack_wait`` redelivers them, effects already applied. The ledger keeps every
ack (or NAK) sent since the last confirmation, with its payload and the connection it
went out on (the client's reconnect count). An echo - a message to the client's own
subscription, queued behind the acks - that comes back on the same connection confirms
every ack sent before it (the server reads a connection in order); an ack whose
connection is gone is sent again, as it was, on the current one. A second ack of a
delivery already acked is ignored by the server, so sending one twice is harmless;
none is dropped before it is confirmed or the broker closes.
"""

from __future__ import annotations

__all__ = ["AckLedger"]


class AckLedger:
    """Acks sent and not yet confirmed: reply subject -> (connection, payload)."""

    __slots__ = ("_unconfirmed",)

    def __init__(self) -> None:
        self._unconfirmed: dict[str, tuple[int, bytes]] = {}

    def __len__(self) -> int:
        return len(self._unconfirmed)

    def sent(self, reply: str, generation: int, payload: bytes = b"") -> None:
        """``payload`` (empty: an ack; ``-NAK``: a hand-back) went to ``reply`` on
        connection ``generation``."""
        self._unconfirmed[reply] = (generation, payload)

    def snapshot(self) -> dict[str, tuple[int, bytes]]:
        """The acks an echo sent now would confirm (take it just before the echo)."""
        return dict(self._unconfirmed)

    def confirmed(self, snapshot: dict[str, tuple[int, bytes]], before: int,
                  after: int) -> None:
        """An echo sent on connection ``before`` came back, the client now being on
        ``after``: the snapshot's acks written on that same connection are received,
        unless the connection changed meanwhile (then nothing is confirmed)."""
        if before != after:
            return
        unconfirmed = self._unconfirmed
        for reply, entry in snapshot.items():
            if entry[0] == before and unconfirmed.get(reply) == entry:
                del unconfirmed[reply]

    def to_resend(self, generation: int) -> list[tuple[str, bytes]]:
        """The acks written on another connection than ``generation``, with their
        payloads: send them again (and record them with :meth:`sent`)."""
        return [(reply, payload) for reply, (sent_on, payload) in self._unconfirmed.items()
                if sent_on != generation]
