#!/usr/bin/env bash
# CI job (optional, not wired into .ci/run): the tests of the libraries whose private
# internals msgpatterns uses, on the OLDEST versions pyproject.toml allows.
#
# The lower bounds are read from pyproject.toml; those versions are installed into a
# throw-away directory put first on PYTHONPATH (the venv is not touched), then the
# Redis, RabbitMQ and idempotency tests run with services required.
#   .ci/oldest.sh                 # uses ./.venv, or PYTHON=/path/to/python
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
TARGET="$(mktemp -d)"
trap 'rm -rf "$TARGET"' EXIT

# "redis[hiredis]>=6.0,<9" -> "redis==6.0": the lower bound of each library with internals
pins="$("$PYTHON" - <<'PY'
import tomllib
from packaging.requirements import Requirement

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
oldest = {}
for texts in extras.values():
    for text in texts:
        req = Requirement(text)
        if req.name in ("redis", "hiredis", "pika"):
            low = [s.version for s in req.specifier if s.operator == ">="]
            if low:
                oldest[req.name] = low[0]
print(" ".join(f"{name}=={version}" for name, version in sorted(oldest.items())))
PY
)"
echo "oldest: $pins"
# shellcheck disable=SC2086
"$PYTHON" -m pip install --quiet --no-deps --target "$TARGET" $pins
PYTHONPATH="$TARGET:src:tests" MSGPATTERNS_REQUIRE_SERVICES=1 "$PYTHON" -m pytest -q -x \
  -p no:cacheprovider \
  tests/test_brokers_redis.py tests/aio/test_redis_async.py tests/aio/test_async_redis_link.py \
  tests/test_brokers_rabbitmq.py tests/aio/test_rabbitmq_async.py \
  tests/test_idempotency_store_result.py tests/test_dead_letter_admin.py \
  tests/test_security_results.py tests/test_security_dependencies.py \
  -k "not sigkill"
