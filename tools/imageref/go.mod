module spillway.dev/tools/imageref

go 1.26.8

// The version kubernetes v1.35.4's go.mod requires (k8s.io/kubernetes/pkg/util/parsers).
require github.com/distribution/reference v0.6.0

require github.com/opencontainers/go-digest v1.0.0 // indirect
