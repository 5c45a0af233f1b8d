"""This node's snapshots, local and remote, however the engine is reached.

The CLI and the server stand on this layer and reach the core and the GPU layer only
through it: ``engine.NodeEngine`` (the engine both the local engine and the node agent's
implement), ``local_engine`` (the engine this process runs itself, built from
``c.GPUSnapshot``, or else the node agent's), ``snapshots`` (each operation over the local
and the remote store, written once), ``remotes`` (the remote store from the settings),
``gpus`` (the GPU layer's few names the faces use), ``checks`` (what ``jupyter
gpu-snapshot check`` reports), ``save_requests`` (what a save asks the kernel on its
control channel), ``timeline_requests`` (its timeline and a rewind, asked there too) and
``fallback`` (a snapshot's work back in a fresh kernel).
"""
