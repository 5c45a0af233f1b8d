"""The node agent's credentials wing: who the caller is, and whose a tree or an image is.

- ``ownership``: the caller (``Caller``, ``PodCaller``) and the check that every process
  of a live tree is theirs and unprivileged;
- ``in_images``: the credentials a criu image would give each restored thread, decoded
  and checked against the caller's before criu runs;
- ``criu_runs_as``: the credentials criu itself runs with for a caller;
- ``criu_wire``: the reader of criu's image files (protobuf, by hand) both checks use.
"""
