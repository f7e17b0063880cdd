"""Multi-LoRA serving (#52): PEFT adapters read and checked at start-up (adapter.py), stacked per layer and module
(stack.py), and applied to a step's rows by adapter in batched matmuls (batch.py). names.py holds the flag's rule and
imports no torch (executor_svc/args.py reads it)."""
