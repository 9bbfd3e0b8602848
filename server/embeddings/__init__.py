"""Embeddings, rerank and score (OpenAI's, Cohere/Jina's and vLLM's shapes) on the cell engine."""
