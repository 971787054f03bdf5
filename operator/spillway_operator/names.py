"""The names the operator gives things in the API: the custom resource's group,
version, kind and plural, and the server-side-apply field manager (DESIGN.md, Names).

The bottom floor of the operator: every room imports it, it imports nothing."""

GROUP = "spillway.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SHORT_NAME = "infdep"
#: Server-side apply's field manager, and the app.kubernetes.io/managed-by value.
FIELD_MANAGER = "spillway"
