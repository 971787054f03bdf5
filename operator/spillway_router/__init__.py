"""spillway-router: an OpenAI-compatible proxy that sends each request to the replica
holding the longest part of its prefix, on the GPU or in the host tier.

The deciding parts (hashing, index, scoring) are pure and import neither vLLM nor
torch; the HTTP proxy, the ZMQ subscriber and the pod watch are thin I/O around them.
"""
