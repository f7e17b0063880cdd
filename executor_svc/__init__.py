"""The executor: model weights, the KV page pools, and one forward per step plan."""
