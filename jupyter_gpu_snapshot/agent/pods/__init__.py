"""The node agent's pods wing: an agent that serves users' pods from the node's namespaces
(``--pods``, a DaemonSet).

- ``identity``: which pod a calling process runs in, as the container runtime's records say;
- ``entry``: how the agent runs its own programs inside a user's container (its loader,
  its libraries, its files named through the agent's root);
- ``entry_program``: the program, run by root alone (no site-packages, no package), that joins the
  container's cgroups and namespaces and runs a command there (stdlib only);
- ``pids``: the agent's pids (the node's) and the container's, each way.
"""
