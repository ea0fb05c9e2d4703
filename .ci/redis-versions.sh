#!/usr/bin/env bash
# CI job: the Redis tests on the OLDEST and the NEWEST redis-py (and hiredis) that
# pyproject.toml allows. msgpatterns/_redispy.py is the one module that uses redis-py's
# internals (each with a fallback); this job shows both ends of the range still work.
#
# Each version set is installed with pip into a throw-away directory put first on
# PYTHONPATH (the venv is not touched), from the package index pip is configured with;
# then the Redis tests run with services required.
#   .ci/redis-versions.sh              # uses ./.venv, or PYTHON=/path/to/python
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

# "redis[hiredis]>=6.0,<9" -> "redis>=6.0,<9" (newest) and "redis==6.0" (oldest), for
# redis and hiredis, read from every extra that names them.
read -r oldest newest < <("$PYTHON" - <<'PY'
import tomllib
from packaging.requirements import Requirement

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
specs = {}
for texts in extras.values():
    for text in texts:
        req = Requirement(text)
        if req.name in ("redis", "hiredis") and req.specifier:
            specs.setdefault(req.name, req.specifier)
oldest = [f"{name}=={next(s.version for s in spec if s.operator == '>=')}"
          for name, spec in sorted(specs.items())]
newest = [f"{name}{spec}" for name, spec in sorted(specs.items())]
print(";".join(oldest), ";".join(newest))
PY
)

TESTS=(
  tests/test_redispy.py tests/test_brokers_redis.py tests/aio/test_redis_async.py
  tests/aio/test_async_redis_link.py tests/test_idempotency_store_result.py
  tests/test_raw_loops.py tests/test_dead_letter_admin.py
)
for pins in "$oldest" "$newest"; do
  target="$(mktemp -d)"
  trap 'rm -rf "$target"' EXIT
  IFS=";" read -r -a requirements <<< "$pins"
  "$PYTHON" -m pip install --quiet --no-deps --target "$target" "${requirements[@]}"
  versions="$(PYTHONPATH="$target" "$PYTHON" -c \
    'import hiredis, redis; print(f"redis {redis.__version__}, hiredis {hiredis.__version__}")')"
  echo "ci: Redis tests on $versions ($pins)"
  PYTHONPATH="$target:src:tests" MSGPATTERNS_REQUIRE_SERVICES=1 "$PYTHON" -m pytest -q -x \
    -p no:cacheprovider "${TESTS[@]}" \
    -k "not (rabbit or Rabbit or pika or kafka or Kafka or nats or Nats)"
  rm -rf "$target"
  trap - EXIT
done
