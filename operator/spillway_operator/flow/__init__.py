"""The steps from an InferenceDeployment to its pods and replicas: the typed spec and
its CRD, the planner's request, the rendered children, the status, rollouts and
disruptions, offload pressure; and the two loops that run them (the reconciler and
the autoscaler). They reach the API server only through :mod:`spillway_operator.plumbing`."""
