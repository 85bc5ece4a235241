"""`npuserve install-monitoring`: Prometheus scrape config, recording rules and alerts, their promtool unit
tests, and a Grafana dashboard, one module per written file (docs/observability.md#monitoring-a-deployment)."""
