"""Text generation: a Llama-family model, its HF loader and tokenizer, and the serving engine."""
