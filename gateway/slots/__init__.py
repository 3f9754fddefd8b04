"""llama.cpp slot KV in kvgate's tiers: a `llama-server` slot saved to a file after a turn, kept in
host memory, on disk or in Redis under the prefix hash chain of its prompt, and restored into any
server with the same model before the conversation's next turn is forwarded there.

`codec` (lossless, checksummed), `store` (the tiers and the block index), `keeper` (slots per
server: which one to pin a request to, when to save and restore). No torch: the gateway without
the engine extra runs all of it.
"""
