# The nexusctl worker image (used by docker-compose.yml).
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md worker.py ./
COPY nexuscrm ./nexuscrm
COPY nexusctl ./nexusctl
COPY workflows ./workflows
COPY activities ./activities
RUN pip install --no-cache-dir ".[mysql]"

ENV NEXUS_LOG_FORMAT=json
CMD ["python", "worker.py"]
