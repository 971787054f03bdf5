{{/* Names */}}
{{- define "spillway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spillway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Cluster-scoped objects of two releases with the same name in two namespaces must not collide. */}}
{{- define "spillway.clusterName" -}}
{{- printf "%s-%s" (include "spillway.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "spillway.leaseName" -}}
{{- default (printf "%s-leader" (include "spillway.fullname" .)) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{- define "spillway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spillway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "spillway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spillway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "spillway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "spillway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spillway
{{- end }}

{{- define "spillway.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator's rules in the namespaces it watches: exactly the requests it makes
(operator/spillway_operator/plumbing/kube.py, handlers.py and watch.py, plus kopf 1.45.2's watches).
tests/integration/test_chart.py compares the rendered rules with an explicit set and
runs the operator with this ServiceAccount's token against a real API server.

- inferencedeployments list, watch: kopf's watch of the resource (the operator reads
  the object from the watch stream; it never GETs it, and kopf writes no finalizer or
  annotation because the operator registers only event handlers).
- inferencedeployments/status patch: the operator's status writes (merge patch),
  the autoscaler's status.autoscaling included.
- inferencedeployments/scale patch: the autoscaler's only write of replicas (the scale
  subresource, one writer; the spec itself is never written).
- deployments, services, configmaps get, list, watch, patch, create: get = read a
  child the watches have not delivered yet (the operator compares against the watches'
  copies); create = a new child is POSTed, and an apply that creates the child is
  authorized as "patch" and "create" both (verified against kube-apiserver 1.35:
  without create the first apply is a 403 "cannot create resource"); patch =
  server-side apply, and the one JSON patch that turns a created child's field
  ownership into the apply's; list, watch = the drift watches (the operator's own,
  label-selected, for deployments and services; kopf's for configmaps), which feed
  that cache. configmaps get also reads the model's
  config.json ConfigMap, whose watch re-plans when it changes.
- leaderworkersets get, list, watch, patch, create: the engine's LeaderWorkerSet when a
  replica spans nodes (spec.engine.nodes), applied like the Deployment; list, watch = its
  label-selected drift watch, which feeds the cache (no read per reconcile); get = a read
  after an apply races its event. Moving between one node and several scales the other
  workload to 0 replicas (patch), so no delete.
- poddisruptionbudgets get, list, watch, patch, create: the engine pods' budget, applied
  like the other children (the watch feeds the operator's cache and repairs a hand
  edit at once); no delete.
- servicemonitors get, patch, create: the engine ServiceMonitor, applied like the other
  children (only when the Prometheus operator's API is served; that discovery request is
  a non-resource URL every authenticated user may read).
- pods list, watch: readiness of the engine pods (list by selector, which also gives the
  autoscaler the pod IPs it scrapes directly, without the API server's proxy) and the
  operator's own label-selected watch. pods patch: before a scale-down the autoscaler annotates the pods that should go
  (controller.kubernetes.io/pod-deletion-cost, spillway.dev/draining) and takes stale
  marks off again; no get (the list gives the pods), no create, delete or subresources.
- secrets get: the optional Hugging Face token Secret named in a spec. The name is the
  user's choice, so resourceNames cannot narrow it; no list or watch is granted.
- events create: the operator's own Events on InferenceDeployments.
Not granted: update, delete, deletecollection anywhere (children are deleted by the
garbage collector through owner references), create of anything but the children and
Events, pods/exec, pods/log, nodes, and any write to the InferenceDeployment's spec.
*/}}
{{- define "spillway.namespacedRules" -}}
- apiGroups: ["spillway.dev"]
  resources: ["inferencedeployments"]
  verbs: ["list", "watch"]
- apiGroups: ["spillway.dev"]
  resources: ["inferencedeployments/status", "inferencedeployments/scale"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "patch", "create"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "patch", "create"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "patch", "create"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "patch", "create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["secrets", "persistentvolumeclaims"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "patch", "create"]
{{- end }}

{{/*
Cluster-scoped reads kopf makes (rbac.clusterScopedReads):
- customresourcedefinitions list, watch: kopf re-scans the API when a CRD changes, so
  an operator started before its CRD was established still finds InferenceDeployments.
- namespaces list, watch: the operator's own watch of namespaces, so that nothing is
  written into one being deleted (no status, Event or re-created child fights the
  deletion); in namespaced mode kopf also resolves the -n namespaces against them and
  follows their creation. Without it (clusterScopedReads: false) a namespace being
  deleted is learned from the API server's refusal of a create in it.
- storageclasses get: an Ephemeral disk tier's storageClassName is checked before any
  pod waits on a claim no class can provision (without it, the pending pod says so).
*/}}
{{- define "spillway.clusterReadRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses"]
  verbs: ["get"]
{{- /* A GPU pool's nodeSelector, listed by label to find nodes of other GPU products
(the MixedGPUProducts condition): list only, no get, watch or write. */}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list"]
{{- end }}

{{/*
spillway-router's endpoint picker (router.endpointPicker): "NAMESPACE/SERVICE:PORT", the
operator's --endpoint-picker, or "" when it is off. The router's Service lives in the
release namespace and an InferencePool names a Service of its own namespace, so pools
are made there only (templates/router.yaml refuses a router.namespace elsewhere).
*/}}
{{- define "spillway.endpointPicker" -}}
{{- $r := .Values.router | default dict }}
{{- $epp := $r.endpointPicker | default dict }}
{{- if and $r.enabled $epp.enabled }}
{{- printf "%s/%s-router:%d" .Release.Namespace (include "spillway.fullname" .) (int (default 9002 $epp.port)) }}
{{- end }}
{{- end }}
