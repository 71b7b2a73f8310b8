"""Training pipelines for the shipped models: corpus, tokenizer, causal-LM training."""
