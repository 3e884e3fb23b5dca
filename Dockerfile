# One image for every Bourse program (supplier, exchange, edge, buyer, bourse): compose.yaml
# picks the program in each service's command. nats-server runs from the official image.
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md ./
COPY bourse ./bourse
COPY exchange ./exchange
COPY supplier ./supplier
COPY buyer_cli ./buyer_cli
COPY ops ./ops
COPY loadtest ./loadtest
COPY edge ./edge
RUN pip install --no-cache-dir . \
    && useradd --system --create-home bourse \
    && mkdir /data && chown bourse /data

# A supplier's SQLite state; compose mounts a named volume here (it keeps this ownership).
VOLUME /data
USER bourse
WORKDIR /home/bourse
CMD ["bourse", "--help"]
