"""Everything that runs inside a launched child process, and the protocol that configures it.

- ``spec``: ``ChildSpec``, the one owner of the settings that travel from the command line to the
  child (the only module that names a ``TORCHREPRO_*`` variable). Imported by both sides.
- ``bootstrap``: ``python -m torchrepro._child.bootstrap``: reads the spec, seeds, sets the
  switches, installs the hooks, then runs the user's script like python would.
- ``hooks``: every patch the child installs on torch or the standard library (recording hooks,
  ``--vary`` patches, the audit's settings probe). Nothing outside the child installs them.

Importing this package imports nothing; the submodules are imported by name.
"""
