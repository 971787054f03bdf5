"""The names the operator gives things in the API: the custom resource's group,
version, kind and plural, and the server-side-apply field manager (docs/design.md, Names).

The bottom floor of the operator: any room may import it; it imports nothing."""

GROUP = "spillway.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SHORT_NAME = "infdep"
#: Server-side apply's field manager, and the app.kubernetes.io/managed-by value.
FIELD_MANAGER = "spillway"

#: The Gateway API Inference Extension's InferencePool (its v1 API, GIE v1.x), which the
#: operator makes per InferenceDeployment when that API is served and an endpoint picker
#: is configured (``spillway operator run --endpoint-picker``).
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"

#: LeaderWorkerSet (sigs.k8s.io/lws): a replica that spans nodes is one of its groups, a
#: leader pod (node rank 0, the API server) and worker pods; LWS labels each pod with its
#: group and its index in it (0: the leader).
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_REVISION = "leaderworkerset.sigs.k8s.io/template-revision-hash"


def inference_pool_name(inference_deployment: str) -> str:
    """An InferenceDeployment's InferencePool: the same name, one pool each, as its
    Service (a Gateway's HTTPRoute names the pool the user knows by that name)."""
    return inference_deployment
