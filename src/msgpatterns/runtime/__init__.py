"""The consumer runtime's parts, each with one job; the thread driver
(:class:`msgpatterns.Consumer`) and the asyncio driver
(:class:`msgpatterns.aio.AsyncConsumer`) compose the same parts and differ only in
how they wait (threads and a condition, or tasks on an event loop).

One message's path: the driver fetches into a free slot (:mod:`.flow`), the handler
runs, its outcome goes to the :mod:`.settler` (``RetryPolicy.decide`` -> broker call
-> counts), and the slot is freed or handed to a retry copy that waits on the
:mod:`.scheduler` (one :mod:`.clock`: real, or virtual for ``run_until_idle`` with the
:mod:`.idle` driver). Ordered mode passes each message through the key :mod:`.gate`.

* :mod:`.fetcher` - the thread driver's fetching, flow control and ready queue.
* :mod:`.settling` - where the thread driver's deliveries report their outcome.
* :mod:`.async_flow` - the asyncio driver's slots, ready queue and wake-ups.
* :mod:`.async_settling` - where the asyncio driver's deliveries report their outcome.
* :mod:`.gate` - ordered mode: one message per key at a time, in delivery order.
* :mod:`.clock` - real or virtual time for delayed retries; the asyncio timer.
* :mod:`.scheduler` - delayed retries on that clock (timers stopped with the consumer).
* :mod:`.settler` - outcome -> decision -> broker operations -> counts (sans I/O).
* :mod:`.flow` - the slots (``max_in_flight``) and what frees them.
* :mod:`.idle` - moving virtual time when nothing can run (``run_until_idle``).
* :mod:`.rounds` - the claim rounds of batch-claimed ``@idempotent`` handlers.
* :mod:`.driver`, :mod:`.lifecycle`, :mod:`.options`, :mod:`.stats` - what both drivers
  hold: checked options, states, counts and their report to telemetry.

These are internals: their names may change between releases.
"""
