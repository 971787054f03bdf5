// kvindexer: llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache, the pinned
// release) subscribed to engine pods' vLLM KV events, driven over stdin/stdout, so a
// test can score prompts with llm-d's own code and compare the scores with Spillway's
// index (tests/contract/test_llmd_indexer.py).
//
// Flags name the model, llm-d's block size (tokens a request key covers: the engines'
// hash unit), the hash seed and the tier weights. Each stdin line is a JSON command,
// each stdout line its JSON answer:
//
//	{"subscribe": ["tcp://10.0.0.1:5557", ...]}  -> {"ok": true}
//	{"score": [token ids]}                        -> {"scores": {"<pod id>": score, ...}}
//	{"stats": true}                               -> {"messages": {"<pod id>": n}, "errors": n}
//
// Pods are named by the middle part of the events' topic (kv@<pod-ip>:<port>@<model>),
// as llm-d's router names them. Nothing here is Spillway's: events are read, keyed and
// scored by the library alone.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

// countingAdapter is llm-d's vLLM adapter, counting the messages it parses per pod, so
// the test knows when the indexer has seen what the engines published.
type countingAdapter struct {
	inner    kvevents.EngineAdapter
	mu       sync.Mutex
	messages map[string]int
	errors   int
}

func (a *countingAdapter) ParseMessage(msg *kvevents.RawMessage) (string, string, kvevents.EventBatch, error) {
	pod, model, batch, err := a.inner.ParseMessage(msg)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.errors++
	} else {
		a.messages[pod]++
	}
	return pod, model, batch, err
}

func (a *countingAdapter) ShardingKey(msg *kvevents.RawMessage) string {
	return a.inner.ShardingKey(msg)
}

func parseWeights(text string) ([]*kvcache.KVCacheBackendConfig, error) {
	var out []*kvcache.KVCacheBackendConfig
	for _, part := range strings.Split(text, ",") {
		name, value, ok := strings.Cut(part, "=")
		if !ok {
			return nil, fmt.Errorf("-weights: %q is not tier=weight", part)
		}
		w, err := strconv.ParseFloat(value, 64)
		if err != nil {
			return nil, fmt.Errorf("-weights: %q: %w", part, err)
		}
		out = append(out, &kvcache.KVCacheBackendConfig{Name: strings.ToLower(name), Weight: w})
	}
	return out, nil
}

type command struct {
	Subscribe []string `json:"subscribe"`
	Score     []uint32 `json:"score"`
	Stats     bool     `json:"stats"`
}

func main() {
	model := flag.String("model", "", "the served model name (the topic's last part)")
	blockSize := flag.Int("block-size", 16, "tokens per llm-d request key (the engines' hash unit)")
	hashSeed := flag.String("hash-seed", "", "llm-d's hash seed (the engines' PYTHONHASHSEED)")
	weights := flag.String("weights", "gpu=1,cpu=0.8,storage=0.4", "tier=weight,...")
	flag.Parse()
	if err := run(*model, *blockSize, *hashSeed, *weights); err != nil {
		fmt.Fprintln(os.Stderr, "kvindexer:", err)
		os.Exit(1)
	}
}

func run(model string, blockSize int, hashSeed, weights string) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	backends, err := parseWeights(weights)
	if err != nil {
		return err
	}
	processor, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{
		BlockSizeTokens: blockSize, HashSeed: hashSeed})
	if err != nil {
		return err
	}
	config, err := kvcache.NewDefaultConfig()
	if err != nil {
		return err
	}
	config.BackendConfigs = backends
	indexer, err := kvcache.NewKVCacheIndexer(ctx, config, processor)
	if err != nil {
		return err
	}
	go indexer.Run(ctx)
	adapter := &countingAdapter{inner: engineadapter.NewVLLMAdapter(), messages: map[string]int{}}
	poolConfig := kvevents.DefaultConfig()
	poolConfig.DiscoverPods = false
	poolConfig.Concurrency = 2
	pool := kvevents.NewPool(poolConfig, indexer.KVBlockIndex(), processor, adapter)
	pool.Start(ctx)
	subscribers := kvevents.NewSubscriberManager(pool)

	out := json.NewEncoder(os.Stdout)
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	if err := out.Encode(map[string]any{"ready": true}); err != nil {
		return err
	}
	for in.Scan() {
		var cmd command
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			return fmt.Errorf("a command that is not JSON: %w", err)
		}
		var answer any
		switch {
		case cmd.Subscribe != nil:
			for _, endpoint := range cmd.Subscribe {
				// remote: connect to the engine's bound publisher, filtered on llm-d's prefix
				if err := subscribers.EnsureSubscriber(ctx, endpoint, endpoint, "kv@", true); err != nil {
					return fmt.Errorf("subscribe %s: %w", endpoint, err)
				}
			}
			answer = map[string]any{"ok": true}
		case cmd.Score != nil:
			scores, err := indexer.ScoreTokens(ctx, cmd.Score, model, nil, nil)
			if err != nil {
				return fmt.Errorf("score: %w", err)
			}
			if scores == nil {
				scores = map[string]float64{}
			}
			answer = map[string]any{"scores": scores}
		case cmd.Stats:
			adapter.mu.Lock()
			counts := make(map[string]int, len(adapter.messages))
			for pod, n := range adapter.messages {
				counts[pod] = n
			}
			answer = map[string]any{"messages": counts, "errors": adapter.errors}
			adapter.mu.Unlock()
		default:
			return fmt.Errorf("unknown command %s", in.Text())
		}
		if err := out.Encode(answer); err != nil {
			return err
		}
	}
	subscribers.Shutdown(ctx)
	return in.Err()
}
