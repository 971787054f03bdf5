// Command imageref answers, for each candidate image reference, what the kubelet
// answers: it parses with github.com/distribution/reference's ParseNormalizedNamed, as
// k8s.io/kubernetes/pkg/util/parsers.ParseImageName does (Kubernetes 1.35.4), with the
// same digest algorithms linked in (crypto/sha256, crypto/sha512).
//
// Input: one candidate per line, each a JSON string literal (so a candidate may hold
// any character, newlines included). Output: one JSON object per line, in order:
// {"ok":true,"name":"<normalised reference>"} or {"ok":false,"error":"<message>"}.
// tests/integration/test_image_reference.py drives it against spillway_operator.imageref.
package main

import (
	"bufio"
	_ "crypto/sha256"
	_ "crypto/sha512"
	"encoding/json"
	"fmt"
	"os"

	dockerref "github.com/distribution/reference"
)

type verdict struct {
	OK    bool   `json:"ok"`
	Name  string `json:"name,omitempty"`
	Error string `json:"error,omitempty"`
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	for in.Scan() {
		var candidate string
		if err := json.Unmarshal(in.Bytes(), &candidate); err != nil {
			fmt.Fprintf(os.Stderr, "imageref: a line is not a JSON string: %v\n", err)
			os.Exit(2)
		}
		v := verdict{}
		if named, err := dockerref.ParseNormalizedNamed(candidate); err != nil {
			v.Error = err.Error()
		} else {
			v.OK, v.Name = true, named.String()
		}
		if err := enc.Encode(v); err != nil {
			fmt.Fprintf(os.Stderr, "imageref: %v\n", err)
			os.Exit(2)
		}
		// Answer each line as it comes, so a caller can talk to one process line by line.
		if err := out.Flush(); err != nil {
			os.Exit(2)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "imageref: %v\n", err)
		os.Exit(2)
	}
}
