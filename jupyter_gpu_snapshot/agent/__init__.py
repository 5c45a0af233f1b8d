"""The node agent: one privileged process per node that does the privileged parts of the
engine (launching a kernel tree in its PID namespace, CUDA's checkpoint calls, criu dump
and restore) for unprivileged users, whom it knows by their socket's peer credentials."""
