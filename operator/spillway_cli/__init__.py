"""The ``spillway`` command line: ``plan`` (the planner), ``operator run`` (the
operator) and ``load`` (a load generator). It imports both the engine's planner and
the operator, so neither of those has to import the other's tools."""
