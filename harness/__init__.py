"""The ``harness`` command line: the top layer, over the gateway, replay, tools and training.

``harness.main`` is the command; each of its groups is a module here (``replay``, ``rewards``, ``training``,
``adapters``, ``approvals``), with what they share in ``support``. Nothing below imports this package.
"""
