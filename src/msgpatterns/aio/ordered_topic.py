"""The asyncio consumer of an :class:`~msgpatterns.ordering.OrderedTopic`.

:meth:`OrderedTopic.async_consumer <msgpatterns.ordering.OrderedTopic.async_consumer>`
builds it: an :class:`~msgpatterns.aio.AsyncConsumer` whose broker is the topic's
:class:`~msgpatterns.ordering.topic_feed.TopicFeed` - the very object the sync
:class:`~msgpatterns.Consumer` of :meth:`~msgpatterns.ordering.OrderedTopic.consumer`
fetches through - behind a :class:`~msgpatterns.brokers.threaded.ThreadedAsyncBroker`.

So the leases, the route following (a partition a change opened waits for every
partition it closed), the command recording, the takeover delay, the refusal of
unrouted messages and ``on_dead_letter`` exist once, in the feed, for both drivers;
only the handler, the key gate, the retries and the settling run on the event loop.
Each feed call (a fetch, a settlement, a lease renewal) runs in a worker thread: the
route stores are sync clients (SQL, Redis), the feed is thread-safe (the sync consumer
calls it from several threads), and the loop never blocks on either.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.brokers.threaded import ThreadedAsyncBroker

if TYPE_CHECKING:
    from msgpatterns.brokers.base import Broker
    from msgpatterns.message import Message
    from msgpatterns.ordering.topic_feed import TopicFeed

__all__ = ["topic_consumer"]


def topic_consumer(feed: TopicFeed, handler: Any, *, broker: Broker | None = None,
                   **options: Any) -> AsyncConsumer:
    """An :class:`AsyncConsumer` of ``feed``'s topic and group (``ordered=True`` by
    default; ``options`` are the AsyncConsumer's). ``broker``: the sync Broker the
    consumer fetches through, by default ``feed`` itself (a wrapper of the feed, such as
    a test's crash simulator, goes here). With ``on_dead_letter="stop"`` the handler
    first refuses a message whose key a dead letter stopped (``feed.check_key``)."""
    options.setdefault("ordered", True)
    if feed.on_dead_letter == "stop":
        handler = checking_stopped_keys(feed, handler)
    return AsyncConsumer(ThreadedAsyncBroker(feed if broker is None else broker), handler,
                         topics=[feed.topic.name], group=feed.group, **options)


def checking_stopped_keys(feed: TopicFeed, handler: Any) -> Any:
    """``handler`` (a coroutine function), refusing first a message whose key a dead
    letter stopped: the consumer then dead-letters it with
    :class:`~msgpatterns.ordering.errors.KeyStopped`."""

    @functools.wraps(handler)
    async def checked(message: Message) -> Any:
        feed.check_key(message)
        return await handler(message)

    return checked
