"""AckWindow (the RabbitMQ adapters' batched acks) against a model of the server's
``basic_ack(multiple=True)``: whatever order deliveries are settled or handed back in,
an ack never covers an unsettled delivery, and every settled one is acked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from msgpatterns.brokers.rabbitmq._ack_window import AckWindow


class Server:
    """A channel's outstanding deliveries, as RabbitMQ keeps them."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.acked: set[int] = set()

    def send(self, window: AckWindow) -> None:
        upto, singles = window.take()
        if upto is not None:
            covered = {t for t in self.outstanding if t <= upto}
            assert upto in covered  # the multiple ack names a real delivery
            self.outstanding -= covered
            self.acked |= covered
        for tag in singles:
            assert tag in self.outstanding  # else: PRECONDITION_FAILED, channel closed
            self.outstanding.discard(tag)
            self.acked.add(tag)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.just(n),
    st.permutations(range(1, n + 1)),
    st.lists(st.sampled_from(["ack", "gone", "hold"]), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n))))
def test_acks_cover_exactly_the_settled_deliveries(case: tuple[int, list[int], list[str],
                                                              list[bool]]) -> None:
    n, order, fates, flush_after = case
    window, server = AckWindow(), Server()
    for tag in range(1, n + 1):
        window.delivered(tag)
        server.outstanding.add(tag)
    settled: set[int] = set()
    for tag, flush in zip(order, flush_after, strict=True):
        fate = fates[tag - 1]
        if fate == "ack":
            assert window.ack(tag)
            settled.add(tag)
        elif fate == "gone":  # basic_nack(requeue) sent: off the channel
            server.outstanding.discard(tag)
            window.gone(tag)
        if flush:
            server.send(window)
            assert server.acked <= settled
    server.send(window)
    assert server.acked == settled
    held = {t for t in range(1, n + 1) if fates[t - 1] == "hold"}
    assert server.outstanding == held
    assert window.pending == 0


def test_in_order_settlement_is_one_multiple_ack() -> None:
    window = AckWindow()
    for tag in range(1, 101):
        window.delivered(tag)
        window.ack(tag)
    assert window.take() == (100, [])


def test_a_held_tag_stops_the_multiple_ack_and_later_ones_go_singly() -> None:
    window = AckWindow()
    for tag in range(1, 6):
        window.delivered(tag)
    for tag in (1, 2, 4, 5):
        window.ack(tag)
    assert window.take() == (2, [4, 5])
    assert not window.ack(4)  # settled once: a second ack is refused
    window.ack(3)
    assert window.take() == (3, [])
    assert window.outstanding == 0
