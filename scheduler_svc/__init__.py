"""The scheduler: public API, tokenization, batching and every KV-memory decision."""
