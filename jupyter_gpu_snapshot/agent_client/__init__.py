"""How unprivileged processes reach the node agent (``jupyter_gpu_snapshot.agent``): the
protocol, a client, and an engine whose work the agent does."""
