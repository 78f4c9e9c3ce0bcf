"""The agent's HTTP API, one module per resource; `node_agent/app.py` includes their routers."""
