"""The node agent's files wing: the kernel's files across the privilege line.

- ``dump_externals``: at a save, which files of the tree criu dumps as external (by key,
  not by path);
- ``restore_plan``: at a restore, what criu would reopen for an image, read from the image,
  and the access each opening needs; what it would open or create by path is refused;
- ``opener``: runs ``opener_program`` as the caller and receives the descriptors it opens;
- ``opener_program``: the program, run as the caller alone (no site-packages, no
  package), that opens each file with the caller's own permissions (stdlib only).
"""
