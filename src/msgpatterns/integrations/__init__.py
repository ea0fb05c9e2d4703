"""Framework integrations: msgpatterns' retries, dead letters and idempotency for
handlers that a framework calls (FastStream subscribers, Celery tasks, Dramatiq actors).

Each integration is a small adapter around the same parts the Consumer uses: the retry
decision is :func:`msgpatterns.settlement.settle` (one place, ``RetryPolicy.decide``),
the wire format of retries and dead letters is the broker adapters' own, and
idempotency is :func:`msgpatterns.idempotent`. Import the submodule you need
(``msgpatterns.integrations.faststream``, ``msgpatterns.integrations.celery``,
``msgpatterns.integrations.dramatiq``; ``msgpatterns.integrations.deadletters`` keeps
their dead letters where ``msgpatterns dlq`` reads them); each needs its framework
installed.
"""

from __future__ import annotations

__all__: list[str] = []
