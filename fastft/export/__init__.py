"""Export for the local-model world: GGUF files (llama.cpp, LM Studio) and Ollama folders, each read back
and checked against the merged model before it is kept.

- `families`: what each architecture becomes in GGUF (names from the `gguf` package, RoPE layouts, experts)
- `vocab`: the tokenizer as ``tokenizer.ggml.*`` metadata
- `writer`: the streaming, atomic GGUF writer (one tensor in memory at a time)
- `reference`: the file run in plain PyTorch from its own tensors and metadata
- `check`: the read-back check (metadata against the tokenizer, answers against the merged model)
- `ollama`: the Modelfile (chat template translated and verified, stop tokens, parameters)
- `save`: `save_gguf`, `save_ollama`
"""

from fastft.export.save import GGUFCheckError, GGUFExport, save_gguf, save_ollama

__all__ = ["GGUFCheckError", "GGUFExport", "save_gguf", "save_ollama"]
