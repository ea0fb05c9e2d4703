"""Checking the options both drivers take (one error text for each mistake)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta

from msgpatterns.errors import ConfigurationError, seconds
from msgpatterns.retry import RetryPolicy

__all__ = ["check_batch", "check_common", "duration", "topic_list"]


def duration(value: float | timedelta | None, option: str,
             where: str = "Consumer") -> float | None:
    """``seconds(value)``, with the option's name in the error."""
    try:
        return seconds(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where} {option}: {exc}") from None


def topic_list(topics: object, where: str = "Consumer") -> list[str]:
    """``topics`` as a non-empty list of non-empty strings (one string is one topic)."""
    if isinstance(topics, str):
        topics = [topics]
    if isinstance(topics, (bytes, bytearray, Mapping)) or not isinstance(topics, Iterable):
        raise ConfigurationError(
            f"{where} topics must be a topic name or a list of them, got {topics!r}"
        )
    names = list(topics)
    if not names:
        raise ConfigurationError(f"{where} needs at least one topic")
    for topic in names:
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(
                f"{where} topics must be non-empty strings, got {topic!r} in {names!r}"
            )
    return names


def check_common(where: str, *, retry: object, dead_letters: object, group: object,
                 name: object, counts: Mapping[str, object]) -> None:
    """Raise :class:`ConfigurationError` naming the first wrong option."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigurationError(
            f"{where} retry must be a RetryPolicy or None, got {type(retry).__name__}"
        )
    if dead_letters is not None and not callable(getattr(dead_letters, "put", None)):
        raise ConfigurationError(
            f"{where} dead_letters must be a DeadLetterStore (with put(record)) or "
            f"None, got {type(dead_letters).__name__}"
        )
    if not isinstance(group, str) or not group:
        raise ConfigurationError(f"{where} group must be a non-empty string, got {group!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigurationError(f"{where} name must be a non-empty string, got {name!r}")
    for option, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(
                f"{where} {option} must be an int of at least 1, got {value!r}"
            )


def check_batch(where: str, *, batch: object, ordered: bool) -> None:
    """Refuse a ``batch`` option that is not a bool, and a batch handler in ordered
    mode (:class:`ConfigurationError`)."""
    if not isinstance(batch, bool):
        raise ConfigurationError(f"{where} batch must be True or False, got {batch!r}")
    if batch and ordered:
        raise ConfigurationError(
            f"{where} batch=True cannot be ordered: a batch mixes keys, and ordered "
            "mode runs each key's messages one at a time; use a per-message handler "
            "with ordered=True (an @idempotent one still claims per batch)"
        )
