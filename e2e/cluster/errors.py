"""The harness's error: below the control plane and its real nodes, which both raise it."""


class ClusterError(RuntimeError):
    """The cluster cannot be started or checked; the message says what to do."""
