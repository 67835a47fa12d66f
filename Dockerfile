# The lastgood service, without torch: the service only moves and hashes bytes.
#   docker build -t lastgood-service .      (docker-compose.yml builds it too)
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# the torch-free client (wire contract: proto stubs, manifest, hashing) and the service, every
# dependency at the version service/requirements.lock pins (made on this Python version)
COPY client/ /app/client/
COPY service/ /app/service/
RUN pip install --constraint /app/service/requirements.lock /app/client /app/service

# the Alembic environment ships in the service package: the service migrates at start unless
# LASTGOOD_AUTO_MIGRATE=false, and `lastgood-service migrate` runs it as a one-shot job
ENV LASTGOOD_DATA_DIR=/var/lib/lastgood

RUN useradd --system --uid 10001 --home-dir /var/lib/lastgood --create-home lastgood
USER lastgood

EXPOSE 8000 50051
CMD ["lastgood-service"]
