# One image for the Halfway API, the worker and the migration job (docker-compose.yml runs it
# three ways). TF_VARIANT picks the TensorFlow build from pyproject.toml's extras:
#
#   docker build -t halfway:gpu .                              # .[gpu]: tensorflow[and-cuda]
#   docker build --build-arg TF_VARIANT=cpu -t halfway:cpu .   # .[train]: CPU-only, smaller
#
# The default command runs the API only, on 0.0.0.0 with token auth (`halfway serve` refuses
# --no-auth off loopback); the worker overrides it with `halfway worker --gpus all`.
#
# A container that trains (`halfway worker`, or `halfway serve` without --no-worker) runs each
# job under bubblewrap, which Docker's defaults forbid: give it the security options the
# worker has in docker-compose.yml (docs/operating-isolation.md says why each is needed).

ARG PYTHON_IMAGE=python:3.11-slim

# Build the project's own wheel in a stage of its own, so setuptools and the source tree never
# reach the runtime image.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY workers ./workers
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ARG TF_VARIANT=gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap (Debian's, not setuid): every training child runs in namespaces of its own, made
# by the unprivileged worker (workers/sandbox.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && bwrap --version

# Every folder a named volume is mounted on exists here, so the volume starts owned by halfway
# (a volume mounted where the image has no folder starts owned by root, and is unwritable).
RUN groupadd --system --gid 10001 halfway \
    && useradd --system --uid 10001 --gid halfway --home-dir /var/lib/halfway \
        --no-create-home --shell /usr/sbin/nologin halfway \
    && mkdir -p /var/lib/halfway/data /var/lib/halfway/artifacts /var/lib/halfway/keras \
        /var/lib/halfway/code \
    && chown -R halfway:halfway /var/lib/halfway

# Dependencies first, from pyproject.toml alone: editing the source does not reinstall
# TensorFlow. The requirement list is the project's dependencies plus one extra, so it cannot
# drift from pyproject.toml. (Relative paths only: tests/test_deploy_files.py runs this step.)
WORKDIR /tmp/halfway-deps
COPY pyproject.toml ./
RUN set -eu; \
    case "$TF_VARIANT" in \
        cpu) extra=train ;; \
        gpu) extra=gpu ;; \
        *) echo "TF_VARIANT must be cpu or gpu, not '$TF_VARIANT'" >&2; exit 2 ;; \
    esac; \
    python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"][sys.argv[1]]))' "$extra" > requirements.txt; \
    pip install --no-cache-dir -r requirements.txt; \
    rm -f requirements.txt pyproject.toml

# Then the project itself (a few hundred kB), without touching the dependencies.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels

# The job sandbox binds this Python installation (interpreter, TensorFlow, Halfway) read-only
# into each job, where the job owns none of it: every folder must be searchable and every file
# readable by others, or a job fails on an import. pip honours the build's umask (022); this
# fails the build if anything slipped through. Nothing secret is ever installed here.
RUN set -eu; \
    prefix=$(python -c 'import sys; print(sys.prefix)'); \
    unreadable=$(find "$prefix" \( -type d ! -perm -o=rx \) \
        -o \( ! -type d ! -type l ! -perm -o=r \) | head -n 5); \
    if [ -n "$unreadable" ]; then \
        echo "not readable inside the job sandbox (others need r, folders r-x):" >&2; \
        echo "$unreadable" >&2; \
        exit 1; \
    fi

# Named volumes mounted on data/ and artifacts/ start with this ownership.
ENV HALFWAY_HOME=/var/lib/halfway \
    HALFWAY_DATA_DIR=/var/lib/halfway/data \
    HALFWAY_ARTIFACT_DIR=/var/lib/halfway/artifacts \
    KERAS_HOME=/var/lib/halfway/keras
WORKDIR /var/lib/halfway
USER 10001:10001

EXPOSE 8000
# Only what the image has: python and urllib (no curl). urlopen raises, so python exits 1, on a
# refused connection and on any 4xx/5xx; /healthz answers 200 only after a database round trip.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('HALFWAY_PORT', '8000'), timeout=4)"]

CMD ["halfway", "serve", "--host", "0.0.0.0", "--no-worker"]
